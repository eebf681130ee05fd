"""HF transformers' continuous batching on our paged attention (ops/integrations/hf_paged.py).

CPU: the block tables built from HF's cache positions against a literal loop, and HF's continuous batching running
the adapter with the golden in place of the kernels: the same greedy tokens as HF's ``paged|sdpa``, through both of
HF's steps (prompt chunks on the prefill, one token per request on the decode op's plan / run). GPU: scripts/hf_generate.py's comparison
(16 ragged requests, 64 new tokens: every step against the reference's teacher-forced logits, tokens against
``paged|sdpa``'s up to each request's first near-tie)."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from golden.paged_prefill import paged_attention_prefill  # noqa: E402
from ops.integrations import hf_paged  # noqa: E402


def test_block_tables_from_positions():
    """Page j of request b is the block holding its token j * block_size; 0 past its pages."""
    bs = 4
    blocks = [[7, 2, 9], [5], [], [1, 3]]
    lens = [10, 4, 0, 5]
    positions = torch.tensor([blk[t // bs] * bs + t % bs for blk, n in zip(blocks, lens) for t in range(n)])
    cum = torch.tensor([0] + lens).cumsum(0)
    tables = hf_paged.block_tables_from_positions(positions, cum, max(lens), bs)
    assert tables.dtype == torch.int32 and tables.shape == (4, 3)
    for b, (blk, n) in enumerate(zip(blocks, lens)):
        for j in range(3):
            assert tables[b, j].item() == (blk[j] if j * bs < n else 0)


def test_tensor_parallel_token_rule():
    """hf_generate.same_tokens: each request is followed while the prefixes agree; a step is compared where the
    sharded model's own margin is at least MARGIN and its argmax is the one-GPU token, a near-tie is skipped, and a
    request stops at its first difference or where the sharded model prefers another token (counted)."""
    from scripts.hf_generate import MARGIN, same_tokens

    saved = {0: ([1, 2, 3], None), 1: ([4, 5, 6], None), 2: ([7, 8], None), 3: ([1, 2, 3], None),
             4: ([1, 2, 3], None)}
    sharded = {0: ([1, 2, 3], [9.0, MARGIN - 0.1, 9.0], None),  # a near-tie at step 1, skipped: step 2 counts
               1: ([4, 5, 6], [9.0, 9.0, 9.0], None),  # the engine differs at step 1: step 2 is not compared
               2: ([0, 8], [9.0, 9.0], None),  # the sharded model prefers another token at step 0
               3: ([1, 2, 3], [9.0, 9.0, 9.0], None),
               4: ([1, 2, 3], [9.0, MARGIN - 0.1, 9.0], None)}  # the engine took the other side of a near-tie
    engine = {0: ([1, 2, 9], None), 1: ([4, 0, 6], None), 2: ([0, 8], None), 3: ([1, 2, 3], None),
              4: ([1, 7, 3], None)}
    assert same_tokens(engine, saved, sharded) == (8, 6, 1)


class _GoldenOp:
    """The ops as the adapter calls them, computed by the golden (what the adapter hands the kernels, checked on the
    CPU): plan(tables, seq_lens[, cum_seq_lens_q], validate=False[, total_q]) then run(q, k_cache, v_cache, plan[,
    out]); a decode plan has one token per request."""

    calls = []  # which op ran each layer of each step

    def __init__(self, cls, **spec):
        self.kind, self.spec = cls.__name__, spec

    def plan(self, block_tables, seq_lens, cum_seq_lens_q=None, validate=True, total_q=None):
        assert block_tables.dtype == torch.int32 and not validate
        if cum_seq_lens_q is None:  # the decode's plan
            cum_seq_lens_q = torch.arange(seq_lens.numel() + 1, dtype=torch.int32)
        else:
            assert cum_seq_lens_q.dtype == torch.int32 and total_q is not None
        return block_tables, seq_lens, cum_seq_lens_q

    def run(self, q, k_cache, v_cache, plan, out=None):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype) if out is None else out
        return self._attend(q, k_cache, v_cache, *plan, out)

    def _attend(self, q, k_cache, v_cache, block_tables, seq_lens, cum, out):
        assert self.spec["kv_layout"] == "NHD"
        _GoldenOp.calls.append(self.kind)
        n = cum.numel() - 1
        o = paged_attention_prefill(q, k_cache, v_cache, block_tables[:n], seq_lens[:n], cum,
                                    scale=self.spec["scale"], kv_layout="NHD")
        out[:o.shape[0]] = o
        return out


def test_continuous_batching_matches_paged_sdpa_on_cpu(monkeypatch):
    from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(hf_paged, "op_instance", lambda cls, **spec: _GoldenOp(cls, **spec))
    _GoldenOp.calls = []
    impl = hf_paged.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=256, initializer_range=0.1, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    prompts = [[1], list(range(5, 45)), list(range(3, 20)), list(range(100, 133))]  # 1 to 40 tokens, pages of 16
    gen = GenerationConfig(max_new_tokens=8, do_sample=False)
    tokens = {}
    for name in ("paged|sdpa", impl):
        model.set_attn_implementation(name)
        cb = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=128)
        outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        tokens[name] = [list(outs[rid].generated_tokens) for rid in sorted(outs, key=lambda r: int(r.split("_")[-1]))]
    assert tokens[impl] == tokens["paged|sdpa"] and all(len(t) == 8 for t in tokens[impl])
    # steps with prompt tokens ran the prefill, steps of one new token per request the decode op
    assert {"PagedAttentionPrefillTileLang", "PagedAttentionDecodeTileLang"} <= set(_GoldenOp.calls)


@pytest.mark.gpu
def test_generation_matches_the_reference_on_gpu():
    from scripts.hf_generate import compare, generate, ragged_prompts, tiny_llama

    impl = hf_paged.register()
    model = tiny_llama(layers=4)
    prompts = ragged_prompts(16, 2000, model.config.vocab_size)
    ref, ref_s = generate(model, prompts, 64, "paged|sdpa")
    ours, ours_s = generate(model, prompts, 64, impl)
    result, _ = compare(model, prompts, ours, ref)
    total = sum(len(t) for t, _ in ours.values())
    print(f"\n{torch.cuda.get_device_name()}: paged|sdpa {total / ref_s:.1f} tokens/s, {impl} {total / ours_s:.1f} "
          f"tokens/s; {result}")
    assert total == 16 * 64
    assert result["clear_steps"] >= result["steps"] // 2  # the comparison is not vacuous
    assert result["ok"], result
