"""HF transformers' DeepSeek-V4 on our mHC ops (ops/integrations/hf_deepseek_v4.py).

CPU (where transformers >= 5.17 is installed): the adapter's parameter mapping and its patch / unpatch logic, with
the goldens standing in for the CUDA ops, so that the patched HF modules must reproduce HF's own outputs and
gradients in fp32. GPU (marked gpu): HF's decoder layer, eager and bf16, against the same layer patched with our
ops, both against a float64 run of HF's layer, forward and backward. Without transformers only the import tests
run (CI).
"""

import copy
import importlib
import logging
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from golden.mhc_post import mhc_post as golden_post
from golden.mhc_pre import mhc_forward_pre

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "ops.integrations.hf_deepseek_v4"


@pytest.fixture(scope="module")
def hf():
    """transformers' modeling_deepseek_v4 (skips where transformers or its DeepSeek-V4 is absent)."""
    pytest.importorskip("transformers")
    return pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


@pytest.fixture(scope="module")
def adapter(hf):
    return importlib.import_module(MODULE)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------- building HF's modules
def make_config(hf, D=64, n=4, iters=20, layers=1, heads=2, head_dim=32, experts=2, window=8, **kw):
    """A small random DeepSeek-V4 config with no discrete choice that rounding could flip: sliding-window
    attention only (no compressor or indexer top-k) and every token routed to every expert (top-k = all)."""
    return hf.DeepseekV4Config(
        vocab_size=64, hidden_size=D, moe_intermediate_size=2 * head_dim, num_hidden_layers=layers,
        num_attention_heads=heads, head_dim=head_dim, q_lora_rank=head_dim, o_groups=2, o_lora_rank=head_dim,
        n_routed_experts=experts, num_experts_per_tok=experts, n_shared_experts=1, sliding_window=window,
        layer_types=["sliding_attention"] * layers, mlp_layer_types=["moe"] * layers, hc_mult=n,
        hc_sinkhorn_iters=iters, attn_implementation="eager", experts_implementation="eager", **kw)


def make_model(hf, config, seed=0):
    """DeepseekV4Model (fp32, HF's initialization) with the hyper-connections' fn, base and scale drawn at the
    scales of a trained layer (mixes of order 1, a nonzero base, distinct scales), so that a mix-up of rows,
    scales or biases shows."""
    torch.manual_seed(seed)
    model = hf.DeepseekV4Model._from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, hf.DeepseekV4HyperConnection):
                m.fn.copy_(torch.randn(m.fn.shape, generator=g) / math.sqrt(m.fn.shape[1]))
                m.base.copy_(torch.randn(m.base.shape, generator=g) * 0.5)
                m.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return model.eval()


def layer_inputs(model, B, S, dtype, device, seed=0):
    """Random residual streams [B, S, n, D] (every stream different) and the decoder layer's keyword arguments as
    HF's model passes them: rotary embeddings, position ids and the additive sliding-window causal mask."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, config.hc_mult, config.hidden_size, generator=g).to(device=device, dtype=dtype)
    pos = torch.arange(S, device=device)[None]
    emb = x[:, :, 0]
    rope = {t: model.rotary_emb(emb, position_ids=pos, layer_type=t) for t in ("main", "compress")}
    i = torch.arange(S, device=device)
    seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - config.sliding_window)
    mask = torch.zeros(S, S, device=device, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[None, None]
    return x, dict(position_embeddings=rope, position_ids=pos, attention_mask=mask)


def run(module, x, kwargs, weights):
    """Forward and backward of loss = sum_i <outputs[i], weights[i]> -> (outputs, {name: gradient}) for the input
    ("input") and every parameter (None where it got none)."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    outs = module(x, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o.to(w.dtype) * w).sum() for o, w in zip(outs, weights)).backward()
    grads = {"input": x.grad, **{name: p.grad for name, p in module.named_parameters()}}
    return tuple(o.detach() for o in outs), grads


def output_weights(outs, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(device=o.device, dtype=dtype) for o in outs]


# ----------------------------------------------------------------------------- CPU: the goldens as our ops
@pytest.fixture
def goldens(adapter, monkeypatch):
    """The adapter's ops replaced by the goldens (any device and dtype); counts their calls."""
    calls = {"pre": 0, "post": 0}

    def pre(x, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters):
        calls["pre"] += 1
        return mhc_forward_pre(x, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters=sinkhorn_iters)

    def post(residual, layer_out, post, comb):
        calls["post"] += 1
        return golden_post(residual, layer_out, post, comb)

    monkeypatch.setattr(adapter, "_pre", pre)
    monkeypatch.setattr(adapter, "_post", post)
    monkeypatch.setattr(adapter, "_accepts", lambda x: True)
    return calls


def assert_same_run(got, want, tol):
    (outs, grads), (ref_outs, ref_grads) = got, want
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.shape == r.shape and o.dtype == r.dtype, (i, o.shape, r.shape, o.dtype, r.dtype)
        assert rel_err(o, r) <= tol, f"output {i}: rel err {rel_err(o, r):.2e} > {tol}"
    assert grads.keys() == ref_grads.keys()
    for name, r in ref_grads.items():
        g = grads[name]
        assert (g is None) == (r is None), name
        if r is not None:
            assert g.dtype == r.dtype and rel_err(g, r) <= tol, f"grad {name}: rel err {rel_err(g, r):.2e} > {tol}"


@pytest.mark.parametrize("iters", [0, 1, 3, 20])
@pytest.mark.parametrize("n", [4, 2, 1])
def test_hyper_connection_matches_hf_cpu(hf, adapter, goldens, n, iters):
    """The patched DeepseekV4HyperConnection (fn -> phi, scale -> alpha, base -> bias, input_norm.eps -> rms_eps,
    hc_eps, max(1, hc_sinkhorn_iters) -> sinkhorn_iters) returns HF's (post, comb, collapsed) and gradients in
    fp32. iters = 0 and 1 both run one Sinkhorn round in HF; 3 against 20 tells the iteration count apart."""
    model = make_model(hf, make_config(hf, n=n, iters=iters))
    hc = model.layers[0].attn_hc
    x, _ = layer_inputs(model, 2, 5, torch.float32, "cpu")
    want = run(hc, x, {}, output_weights(hc(x), torch.float32))
    adapter.patch_deepseek_v4(hc)
    assert adapter.is_patched(hc)
    got = run(hc, x, {}, output_weights(hc(x), torch.float32))
    assert goldens["pre"] == 2
    assert [o.dtype for o in got[0]] == [torch.float32] * 3
    assert_same_run(got, want, 1e-5)
    args = adapter.hc_arguments(hc)
    assert args["phi"] is hc.fn and args["alpha"] is hc.scale and args["bias"] is hc.base  # fp32: no copy
    assert args["sinkhorn_iters"] == max(1, iters) and args["rms_eps"] == model.config.rms_norm_eps


def test_sinkhorn_iters_mapping(hf, adapter):
    """HF's 0 Sinkhorn iterations still normalize (softmax, then the columns once): our 1, not our 0."""
    model = make_model(hf, make_config(hf, iters=0))
    hc = model.layers[0].attn_hc
    x, _ = layer_inputs(model, 1, 3, torch.float32, "cpu")
    _, comb, _ = hc(x)
    assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-5)  # column sums 1: not the raw logits
    args = adapter.hc_arguments(hc)
    assert args["sinkhorn_iters"] == 1
    _, _, golden_comb = mhc_forward_pre(x, **args)
    assert rel_err(golden_comb, comb) < 1e-6


@pytest.mark.parametrize("n,iters", [(4, 20), (2, 3), (8, 2)])
def test_decoder_layer_matches_hf_cpu(hf, adapter, goldens, n, iters):
    """The patched DeepseekV4DecoderLayer (both hyper-connections and both post mixings replaced) reproduces HF's
    layer in fp32: output, the gradient of the input and of every parameter."""
    model = make_model(hf, make_config(hf, n=n, iters=iters))
    layer = model.layers[0]
    x, kwargs = layer_inputs(model, 2, 12, torch.float32, "cpu")
    weights = output_weights((layer(x, **kwargs),), torch.float32)
    want = run(layer, x, kwargs, weights)
    adapter.patch_deepseek_v4(layer)
    assert all(adapter.is_patched(m) for m in (layer, layer.attn_hc, layer.ffn_hc))
    got = run(layer, x, kwargs, weights)
    assert goldens == {"pre": 2, "post": 2}
    assert all(g is not None for g in want[1].values())
    assert_same_run(got, want, 1e-5)
    adapter.unpatch_deepseek_v4(layer)
    assert not any(adapter.is_patched(m) for m in layer.modules())
    again = run(layer, x, kwargs, weights)
    assert goldens == {"pre": 2, "post": 2}
    assert_same_run(again, want, 0)  # HF's own code again, bitwise


def test_model_patch_walks_every_layer_cpu(hf, adapter, goldens):
    """Patching a whole DeepseekV4Model patches each layer and its two hyper-connections (not the final
    HyperHead), leaves state_dict as it was, and reproduces the model's output from token ids."""
    model = make_model(hf, make_config(hf, layers=2))
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).last_hidden_state
    keys = list(model.state_dict())
    assert adapter.patch_deepseek_v4(model) is model
    patched = [name for name, m in model.named_modules() if adapter.is_patched(m)]
    assert patched == ["layers.0", "layers.0.attn_hc", "layers.0.ffn_hc", "layers.1", "layers.1.attn_hc",
                       "layers.1.ffn_hc"]
    assert list(model.state_dict()) == keys
    got = model(input_ids=ids).last_hidden_state
    assert goldens == {"pre": 4, "post": 4}
    assert rel_err(got, want) < 1e-5
    adapter.patch_deepseek_v4(model)  # idempotent
    assert [name for name, m in model.named_modules() if adapter.is_patched(m)] == patched
    twin = copy.deepcopy(model)  # a copy stays patched, bound to the copy
    assert twin.layers[1].forward.__self__ is twin.layers[1] and adapter.is_patched(twin.layers[1].ffn_hc)
    adapter.unpatch_deepseek_v4(model)
    assert not any(adapter.is_patched(m) for m in model.modules())
    assert adapter.is_patched(twin.layers[0])
    assert torch.equal(model(input_ids=ids).last_hidden_state, want)


def test_fallback_for_inputs_our_ops_do_not_take(hf, adapter, caplog):
    """With the real ops, a CPU (or non-bf16) residual runs HF's own code: the same bits, and one warning."""
    model = make_model(hf, make_config(hf))
    layer = model.layers[0]
    x, kwargs = layer_inputs(model, 1, 6, torch.float32, "cpu")
    want = layer(x, **kwargs)
    adapter.patch_deepseek_v4(layer)
    adapter._warned.clear()
    with caplog.at_level(logging.WARNING, logger="llm_tile_ops"):
        assert torch.equal(layer(x, **kwargs), want)
        assert torch.equal(layer(x, **kwargs), want)
    warnings = [r.getMessage() for r in caplog.records if "hf_deepseek_v4" in r.getMessage()]
    assert len(warnings) == 2 and "DeepseekV4DecoderLayer" in warnings[0], warnings  # layer, then its hc: once each


def test_patch_refuses(hf, adapter):
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module"):
        adapter.patch_deepseek_v4("layer")
    with pytest.raises(ValueError, match="found none in Linear"):
        adapter.patch_deepseek_v4(torch.nn.Linear(4, 4))

    def hc(**kw):
        cfg = dict(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=64) | kw
        return hf.DeepseekV4HyperConnection(types.SimpleNamespace(**cfg))

    for kw, match in ((dict(hc_mult=9), "hc_mult in 1..8"), (dict(hidden_size=60), "multiple of 8"),
                      (dict(hidden_size=16392), "multiple of 8 in 8..16384"),
                      (dict(hc_sinkhorn_iters=101), "hc_sinkhorn_iters <= 100")):
        bad = hc(**kw)
        box = torch.nn.ModuleList([hc(), bad])
        with pytest.raises(ValueError, match=match):
            adapter.patch_deepseek_v4(box)
        assert not any(adapter.is_patched(m) for m in box.modules()), "nothing patched when one is refused"

    class Custom(hf.DeepseekV4HyperConnection):
        def forward(self, hidden_streams):
            return super().forward(hidden_streams)

    custom = Custom(types.SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                                          hidden_size=64))
    with pytest.raises(TypeError, match="overrides HF's forward"):
        adapter.patch_deepseek_v4(custom)


# ----------------------------------------------------------------------------- imports (run without transformers)
def test_import_without_transformers_raises(monkeypatch):
    """Without transformers the adapter's import fails with a clear ImportError (and ``ops`` never needs it)."""
    for name in list(sys.modules):
        if name == "transformers" or name.startswith("transformers.") or name == MODULE:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ImportError, match=r"needs HF transformers .*pip install 'transformers>=5\.17'"):
        importlib.import_module(MODULE)
    import ops.integrations  # noqa: F401  (the package itself imports nothing)


def test_ops_import_does_not_import_transformers():
    code = ("import sys, ops, ops.integrations; "
            "assert 'transformers' not in sys.modules and not any(m.startswith('ops.integrations.') for m in "
            "sys.modules), sorted(m for m in sys.modules if 'transformers' in m or 'integrations' in m)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- GPU: HF eager against our ops
U_BF16 = 2.0 ** -8  # bf16's unit roundoff (8 significant bits, round to nearest)
SMALL = 64  # gradients with fewer elements are judged together with the rest of their module's (see compare_three)


def _errors(o, h, r):
    r = r.double()
    return (rel_err(o, r), rel_err(h, r), rel_err(o, h), (o.double() - r).abs().max().item(),
            (h.double() - r).abs().max().item(), r.abs().max().item())


def error_table(ours, hf_run, ref):
    """[(name, judged, e_ours, e_hf, e_ours_vs_hf, m_ours, m_hf, max|ref|)] for the outputs, every gradient and, for
    each module owning a gradient of fewer than SMALL elements, all of that module's gradients concatenated
    ("grads of attn_hc.*"): e(a) = ||a - ref|| / ||ref|| (Frobenius, float64), m(a) = max|a - ref|. ``judged`` is
    False for the small gradients themselves (listed, judged within their module's row)."""
    (outs, grads), (hf_outs, hf_grads), (ref_outs, ref_grads) = ours, hf_run, ref
    named = [(f"output {i}", o, h, r) for i, (o, h, r) in enumerate(zip(outs, hf_outs, ref_outs))]
    assert grads.keys() == hf_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        if ref_grads[name] is None:
            assert grads[name] is None and hf_grads[name] is None, name
            continue
        named.append((f"grad {name}", grads[name], hf_grads[name], ref_grads[name]))
    table, modules = [], []
    for name, o, h, r in named:
        assert o.shape == h.shape == r.shape and o.dtype == h.dtype, (name, o.shape, h.shape, o.dtype, h.dtype)
        assert torch.isfinite(o).all(), f"{name}: not finite"
        small = name.startswith("grad ") and o.numel() < SMALL
        if small:
            module = name[len("grad "):].rpartition(".")[0].split(".")[0]  # "attn_hc.scale" -> "attn_hc"; "scale" -> ""
            modules += [module] if module not in modules else []
        table.append((name, not small, *_errors(o, h, r)))
    for module in modules:
        prefix = f"grad {module}." if module else "grad "
        members = [(o, h, r) for name, o, h, r in named if name.startswith(prefix)]
        o, h, r = (torch.cat([m[i].double().flatten() for m in members]) for i in range(3))
        table.append((f"grads of {module or 'the module'}.* together", True, *_errors(o, h, r)))
    return table


def compare_three(ours, hf_run, ref):
    """Each tensor of our bf16 run and HF's own bf16 run against a float64 run of the same module (HF's code, the
    same parameter values and inputs). The bf16 tolerance is what HF's own bf16 run shows on that tensor,
    relative to its magnitude (``error_table``):
        e(ours) <= 2 e(hf) + u    and    m(ours) <= 4 m(hf) + u max|ref|,    u = 2^-8 (bf16's unit roundoff),
    i.e. ours is at most about as far from the exact result as HF's own bf16 computation (within a factor for two
    independent roundings), with a floor of one bf16 rounding for tensors that HF happens to get almost exact.
    HF's error is a sound yardstick only where it is measured over many numbers: a gradient of a few elements
    (a hyper-connection's scale [3], attention sinks [heads]) is a sum with heavy cancellation whose bf16 error is
    1-6% in both runs, and HF's may be tiny by chance; such gradients are judged with all of their module's
    gradients concatenated (the scale with fn and base). Returns the table's rows (printable) and the failures."""
    rows, failures = [], []
    for name, judged, e_ours, e_hf, e_diff, m_ours, m_hf, top in error_table(ours, hf_run, ref):
        ok = e_ours <= 2 * e_hf + U_BF16 and m_ours <= 4 * m_hf + U_BF16 * top
        mark = "" if ok else "  FAIL" if judged else "  (judged with its module)"
        rows.append(f"{name:42s} e_ours {e_ours:.2e} e_hf {e_hf:.2e} ours-vs-hf {e_diff:.2e} m_ours {m_ours:.2e} "
                    f"m_hf {m_hf:.2e}{mark}")
        if judged and not ok:
            failures.append(name)
    return rows, failures


@pytest.fixture
def counted_ops(adapter, monkeypatch):
    """The adapter's real ops, counted (so a silent fallback to HF's code cannot pass)."""
    calls = {"pre": 0, "post": 0}
    real_pre, real_post = adapter._pre, adapter._post

    def pre(*args, **kwargs):
        calls["pre"] += 1
        return real_pre(*args, **kwargs)

    def post(*args, **kwargs):
        calls["post"] += 1
        return real_post(*args, **kwargs)

    monkeypatch.setattr(adapter, "_pre", pre)
    monkeypatch.setattr(adapter, "_post", post)
    return calls


def three_copies(module, hc_dtype, device):
    """(HF's bf16 module, the same to patch, the float64 reference) on ``device``, with the same parameter values:
    bf16 everywhere, except the hyper-connections' fn / base / scale in ``hc_dtype`` (fp32 as HF checkpoints keep
    them, ``_keep_in_fp32_modules_strict``; bf16 as a model cast wholesale)."""
    base = copy.deepcopy(module).to(device)
    with torch.no_grad():
        for name, p in base.named_parameters():
            is_hc = name.split(".")[-1] in ("fn", "base", "scale") and ("_hc" in name or "." not in name)
            p.data = p.data.to(hc_dtype if is_hc else torch.bfloat16)
    return base, copy.deepcopy(base), copy.deepcopy(base).double()


def hyper_connection_case(hf, adapter, D, hc_dtype, device, tokens=(3, 77), seed=0):
    """DeepseekV4HyperConnection alone (n = 4, 20 Sinkhorn iterations): HF's bf16 module and the patched one against
    the float64 module, (post, comb, collapsed) and the gradients of the input, fn, base and scale."""
    model = make_model(hf, make_config(hf, D=D, n=4, iters=20), seed=seed)
    hf_hc, our_hc, ref_hc = three_copies(model.layers[0].attn_hc, hc_dtype, device)
    adapter.patch_deepseek_v4(our_hc)
    x = torch.randn(*tokens, 4, D, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    weights = output_weights(hf_hc(x), torch.float32, seed=seed + 1)
    ours, hf_run = run(our_hc, x, {}, weights), run(hf_hc, x, {}, weights)
    ref = run(ref_hc, x.double(), {}, [w.double() for w in weights])
    return ours, hf_run, ref


def decoder_layer_case(hf, adapter, D, hc_dtype, device, B=2, S=64, seed=0):
    """A DeepseekV4DecoderLayer from a small random config (n = 4, 20 Sinkhorn iterations, 4 heads of 64, 4 experts
    all routed, sliding window 16): HF's bf16 layer, eager, and the patched one against the float64 layer."""
    config = make_config(hf, D=D, n=4, iters=20, heads=4, head_dim=64, experts=4, window=16)
    model = make_model(hf, config, seed=seed)
    hf_layer, our_layer, ref_layer = three_copies(model.layers[0], hc_dtype, device)
    model.rotary_emb.to(device)
    adapter.patch_deepseek_v4(our_layer)
    x, kwargs = layer_inputs(model, B, S, torch.bfloat16, device, seed=seed + 3)
    _, ref_kwargs = layer_inputs(model, B, S, torch.float64, device, seed=seed + 3)
    weights = output_weights((hf_layer(x, **kwargs),), torch.float32, seed=seed + 1)
    ours, hf_run = run(our_layer, x, kwargs, weights), run(hf_layer, x, kwargs, weights)
    ref = run(ref_layer, x.double(), ref_kwargs, [w.double() for w in weights])
    assert ours[0][0].dtype == torch.bfloat16 and all(g is not None for g in ref[1].values())
    return ours, hf_run, ref


@pytest.mark.parametrize("case", ["hyper_connection", "decoder_layer"])
def test_bf16_tolerance_with_goldens_cpu(hf, adapter, goldens, case):
    """The GPU tests' bf16 comparison on the CPU, with the goldens (our ops' semantics: fp32 math, h_in and the new
    residual rounded once) in the ops' place: our semantics sit within the tolerance HF's own bf16 run defines."""
    if case == "hyper_connection":
        runs = hyper_connection_case(hf, adapter, 64, torch.float32, "cpu", tokens=(2, 9))
    else:
        runs = decoder_layer_case(hf, adapter, 64, torch.bfloat16, "cpu", S=24)
    rows, failures = compare_three(*runs)
    assert not failures, "\n".join(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("hc_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [4096, 520])
def test_hyper_connection_matches_hf_gpu(hf, adapter, counted_ops, D, hc_dtype):
    """DeepseekV4HyperConnection alone: HF eager against ops.mhc_pre (``hyper_connection_case``). D = 4096 runs the
    pre's single pass, 520 its two kernels."""
    rows, failures = compare_three(*hyper_connection_case(hf, adapter, D, hc_dtype, "cuda"))
    assert counted_ops == {"pre": 1, "post": 0}
    print("\n" + "\n".join(rows))
    assert not failures, "\n".join(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("hc_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [4096, 520])
def test_decoder_layer_matches_hf_gpu(hf, adapter, counted_ops, D, hc_dtype):
    """The issue's real-client test: a DeepseekV4DecoderLayer from a small random config (no weights downloaded),
    run (a) as HF ships it, eager, bf16 and (b) patched with our ops (``decoder_layer_case``); the output and the
    gradients of the input and of every parameter agree within bf16 tolerance (``compare_three``: relative to a
    float64 run of HF's layer)."""
    rows, failures = compare_three(*decoder_layer_case(hf, adapter, D, hc_dtype, "cuda"))
    assert counted_ops == {"pre": 2, "post": 2}
    print("\n" + "\n".join(rows))
    assert not failures, "\n".join(rows)
