"""Greedy generation with HF transformers' continuous batching on our paged attention (GPU), beside HF's own
``paged|sdpa`` in the same process: a small random-weight Llama-style model (GQA), ragged prompts.

    python scripts/hf_generate.py [--requests 16] [--max-prompt 2000] [--new-tokens 64] [--layers 4] [--save F]
    torchrun --nproc-per-node 2 scripts/hf_generate.py --against F    # HF's tensor parallelism on two GPUs

Prints the throughput of each (generated tokens / s, end to end) and the comparison of ``compare``: every step of
ours checked against the reference model's teacher-forced logits on our own tokens (the log-probability of each
chosen token, and the chosen token itself wherever the reference's top-1 margin is clear), and the tokens of the
two engines up to each request's first difference. Under torchrun the model is sharded by HF's tensor-parallel plan,
the same comparison runs against the sharded model, and both engines' tokens are compared with a one-GPU run's
(``--save`` there, ``--against`` here; see ``same_tokens``).
"""

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

MARGIN = 0.5  # a top-1 lead (in logits) below this is a near-tie: bf16 rounding may flip the argmax


def tiny_llama(layers: int = 4, seed: int = 0, tensor_parallel: bool = False):
    """A random-weight Llama-style model: 8 query heads over 2 kv heads of 128 dims, bf16, on the GPU (or, with
    ``tensor_parallel``, sharded over this torchrun job's GPUs by HF's tensor-parallel plan). The initializer's
    spread gives logits of order 1-10, so most greedy steps have a clear winner.

    Built once in fp32, saved, and loaded by ``from_pretrained`` as a real checkpoint is, on one GPU as under
    tensor parallelism: casting the built model with ``.to(bfloat16)`` would also round RoPE's inverse frequencies
    (a buffer outside the checkpoint, which loading keeps in fp32) to bf16, a different model (logits up to ~10
    apart at 2000 tokens)."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    path = f"/tmp/llm_tile_ops_tiny_llama_{layers}_{seed}"
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        torch.manual_seed(seed)
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=128, vocab_size=4096, max_position_embeddings=8192,
                          initializer_range=0.1, attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
                          pad_token_id=None)
        LlamaForCausalLM(cfg).save_pretrained(path)
    if distributed:
        dist.barrier()
    if tensor_parallel:
        model = LlamaForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)
    else:
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    model.generation_config.eos_token_id = None
    return model.eval()


def ragged_prompts(requests: int, max_prompt: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_prompt + 1, (requests,), generator=g).tolist()
    lens[0], lens[-1] = 1, max_prompt  # the extremes always
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def generate(model, prompts, new_tokens: int, attn_implementation: str, block_size: int = 256):
    """{request index: (tokens, logprobs)} of greedy continuous batching with the given paged implementation, and
    the seconds it took (after a first, untimed run that builds and captures everything)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(attn_implementation)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False)  # no eos: every request runs to the end
    cb = ContinuousBatchingConfig(block_size=block_size, return_logprobs=True, num_blocks=4096, max_batch_tokens=4096)
    for timed in (False, True):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    # request ids count up in the order the prompts were given
    order = sorted(outs, key=lambda rid: int(rid.rsplit("_", 1)[-1]))
    return {i: (list(outs[rid].generated_tokens), list(outs[rid].logprobs)) for i, rid in enumerate(order)}, seconds


@torch.no_grad()
def teacher_forced(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference model's (log-probabilities, logits) [len(tokens), vocab] (fp32) at each generated step, given
    the prompt and the tokens before it (one plain forward, HF's non-paged sdpa)."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
    logits = model(ids).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1), logits


def _check_steps(model, prompt, tokens, logprobs):
    """Per generated step against the teacher-forced reference: (|logprob error| per step, clear-margin steps,
    of them choosing the reference's argmax, the margins, the reference's logits [steps, vocab])."""
    logp, logits = teacher_forced(model, prompt, tokens)
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).tolist()
    best = logits.argmax(-1).tolist()
    errs = [abs(lp - logp[t, tok].item()) for t, (tok, lp) in enumerate(zip(tokens, logprobs))]
    clear = [t for t in range(len(tokens)) if margin[t] >= MARGIN]
    return errs, len(clear), sum(tokens[t] == best[t] for t in clear), margin, logits


def compare(model, prompts, ours: dict, ref: dict) -> tuple[dict, dict]:
    """Ours against the reference (see the module docstring). Each engine's per-step log-probabilities are checked
    against the same teacher-forced reference (HF's plain sdpa forward on that engine's own tokens), so bf16
    tolerance is what HF's own ``paged|sdpa`` shows there: ours must stay within twice its worst error (and 0.1).
    ``ok``: every clear-margin step of ours chose the reference's token, every step's log-probability error is
    within that bound, every request got all its tokens, and the two engines' tokens agree up to each request's
    first difference, at every step where the reference's margin is clear (a near-tie may flip, and past the first
    difference the two continue from different prefixes). Also returns, per request, the reference's logits at each
    of our steps (what a tensor-parallel run is compared with)."""
    ours_errs, ref_errs, clear, logits_of = [], [], 0, {}
    chosen_ok = tokens_cmp = tokens_ok = 0
    complete = True
    for i, prompt in enumerate(prompts):
        toks, lps = ours[i]
        complete &= len(lps) == len(toks) == len(ref[i][0])
        errs, n_clear, n_ok, margin, logits = _check_steps(model, prompt, toks, lps)
        logits_of[i] = logits.cpu()
        ours_errs += errs
        clear += n_clear
        chosen_ok += n_ok
        ref_errs += _check_steps(model, prompt, *ref[i])[0]
        for t, (a, b) in enumerate(zip(toks, ref[i][0])):
            if margin[t] >= MARGIN:
                tokens_cmp += 1
                tokens_ok += a == b
            if a != b:  # the prefixes differ from here on
                break
    bound = max(0.1, 2 * max(ref_errs))
    return dict(steps=len(ours_errs), clear_steps=clear, clear_steps_matching=chosen_ok,
                worst_logprob_err=max(ours_errs), mean_logprob_err=sum(ours_errs) / len(ours_errs),
                ref_worst_logprob_err=max(ref_errs), ref_mean_logprob_err=sum(ref_errs) / len(ref_errs),
                logprob_bound=bound, ref_tokens_compared=tokens_cmp, ref_tokens_matching=tokens_ok,
                ok=complete and chosen_ok == clear and max(ours_errs) <= bound and tokens_ok == tokens_cmp), logits_of


def sharded_choices(model, prompts, saved: dict) -> dict:
    """Per request, the sharded model's teacher-forced view of the one-GPU run's tokens (identical inputs): per step
    its argmax, its top-1 margin and its largest logit difference from the one-GPU model (saved beside the tokens).
    Sharded matmuls sum in another order, so the two models' bf16 logits differ by rounding that grows through the
    layers, and near-ties may flip between the models themselves."""
    out = {}
    for i, prompt in enumerate(prompts):
        toks, logits = saved[i]
        mine = teacher_forced(model, prompt, toks)[1]
        top2 = mine.topk(2, dim=-1).values
        out[i] = (mine.argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist(),
                  (mine - logits.cuda()).abs().amax(-1).tolist())
    return out


def same_tokens(tokens: dict, saved: dict, sharded: dict) -> tuple[int, int, int]:
    """(steps compared, steps equal, requests where the sharded model itself prefers another token) of ``tokens``
    (the sharded run's) against the one-GPU run's. Each request is followed while the prefixes are equal, up to its
    first difference. A step where the sharded model's own top-1 margin on that prefix is at least MARGIN binds its
    engine to that argmax (the rule of ``compare``): where the argmax is the one-GPU token, the step is compared;
    where it is not, the two models differ there (rounding, not the engine) and the request stops. Near-ties are
    not compared (either token is right) but the request goes on while the tokens agree."""
    compared = equal = models_differ = 0
    for i, (ref_toks, _) in saved.items():
        best, margin, _ = sharded[i]
        for t, (a, b) in enumerate(zip(tokens[i][0], ref_toks)):
            if margin[t] >= MARGIN:
                if best[t] != b:
                    models_differ += 1
                    break
                compared += 1
                equal += a == b
            if a != b:  # the prefixes differ from here on
                break
    return compared, equal, models_differ


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--save", help="one GPU: write our tokens and the reference's logits here")
    parser.add_argument("--against", help="tensor parallel (under torchrun): compare with a one-GPU run's --save")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("scripts/hf_generate.py runs HF continuous batching on the GPU.")
    from ops.integrations.hf_paged import register

    ours_impl = register()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        model = tiny_llama(args.layers, tensor_parallel=True)
    else:
        model = tiny_llama(args.layers)
    prompts = ragged_prompts(args.requests, args.max_prompt, model.config.vocab_size)
    ref, ref_s = generate(model, prompts, args.new_tokens, "paged|sdpa")
    ours, ours_s = generate(model, prompts, args.new_tokens, ours_impl)
    total = sum(len(t) for t, _ in ours.values())
    summary, logits_of = compare(model, prompts, ours, ref)  # under torchrun every rank runs the sharded forwards
    saved = sharded = None
    if world > 1 and args.against:
        saved = {int(i): run for i, run in torch.load(args.against, weights_only=True).items()}
        sharded = sharded_choices(model, prompts, saved)
    if world > 1 and dist.get_rank() != 0:
        dist.barrier()
        return
    print(f"device: {world} x {torch.cuda.get_device_name()}; {args.requests} requests, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each")
    print(f"paged|sdpa        : {total / ref_s:9.1f} tokens/s ({ref_s:.2f} s)")
    print(f"{ours_impl}: {total / ours_s:9.1f} tokens/s ({ours_s:.2f} s), {ref_s / ours_s:.2f}x")
    print("comparison:", summary)
    if saved is not None:
        steps = sorted(x for _, _, diff in sharded.values() for x in diff)
        print(f"tensor parallel vs one GPU: largest logit difference on identical inputs, per step: median "
              f"{steps[len(steps) // 2]:.3f}, largest {steps[-1]:.3f}; tokens compared while prefixes agree and the "
              f"sharded model's margin is at least {MARGIN}:")
        for name, run in ((ours_impl, ours), ("paged|sdpa", ref)):
            compared, equal, models_differ = same_tokens(run, saved, sharded)
            print(f"  {name}: {equal} of {compared} tokens equal to one GPU's; requests stopped where the sharded "
                  f"model itself prefers another token: {models_differ}")
    if args.save:
        torch.save({i: (toks, logits_of[i]) for i, (toks, _) in ours.items()}, args.save)
    if world > 1:
        dist.barrier()


if __name__ == "__main__":
    main()
