"""Greedy generation with HF transformers' continuous batching on our paged attention (GPU), beside HF's own
``paged|sdpa`` in the same process: a small random-weight Llama-style model (GQA), ragged prompts.

    python scripts/hf_generate.py [--requests 16] [--max-prompt 2000] [--new-tokens 64] [--layers 4]

Prints the throughput of each (generated tokens / s, end to end) and the comparison of ``compare``: every step of
ours checked against the reference model's teacher-forced logits on our own tokens (the log-probability of each
chosen token, and the chosen token itself wherever the reference's top-1 margin is clear), and the tokens of the
two engines up to each request's first near-tie.
"""

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

MARGIN = 0.5  # a top-1 lead (in logits) below this is a near-tie: bf16 rounding may flip the argmax


def tiny_llama(layers: int = 4, attn_implementation: str = "sdpa", seed: int = 0):
    """A random-weight Llama-style model: 8 query heads over 2 kv heads of 128 dims, bf16, on the GPU. The
    initializer's spread gives logits of order 1-10, so most greedy steps have a clear winner."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, vocab_size=4096, max_position_embeddings=8192,
                      initializer_range=0.1, attn_implementation=attn_implementation, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


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
def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The reference model's log-probabilities [len(tokens), vocab] (fp32) at each generated step, given the prompt
    and the tokens before it (one plain forward, HF's non-paged sdpa)."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
    logits = model(ids).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1), logits


def compare(model, prompts, ours: dict, ref: dict, logprob_atol: float = 0.15) -> dict:
    """Ours against the reference, per step (see the module docstring). Returns counts; ``ok`` is whether every
    clear-margin step chose the reference's token, every step's log-probability agreed within ``logprob_atol`` (bf16
    activations through a few layers), and the two engines' tokens agreed up to each request's first near-tie."""
    steps = clear = chosen_ok = lp_ok = tokens_cmp = tokens_ok = 0
    worst_lp = 0.0
    for i, prompt in enumerate(prompts):
        toks, lps = ours[i]
        logp, logits = teacher_forced(model, prompt, toks)
        top2 = logits.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).tolist()
        best = logits.argmax(-1).tolist()
        for t, tok in enumerate(toks):
            steps += 1
            err = abs(lps[t] - logp[t, tok].item()) if t < len(lps) else float("inf")
            worst_lp = max(worst_lp, err)
            lp_ok += err <= logprob_atol
            if margin[t] >= MARGIN:
                clear += 1
                chosen_ok += tok == best[t]
        ref_toks = ref[i][0]
        for t, (a, b) in enumerate(zip(toks, ref_toks)):
            if margin[t] < MARGIN:
                break  # past a near-tie the two sequences may legitimately differ
            tokens_cmp += 1
            tokens_ok += a == b
    return dict(steps=steps, clear_steps=clear, clear_steps_matching=chosen_ok, logprobs_within_tol=lp_ok,
                worst_logprob_err=worst_lp, ref_tokens_compared=tokens_cmp, ref_tokens_matching=tokens_ok,
                ok=chosen_ok == clear and lp_ok == steps and tokens_ok == tokens_cmp)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("scripts/hf_generate.py runs HF continuous batching on the GPU.")
    from ops.integrations.hf_paged import register

    ours_impl = register()
    model = tiny_llama(args.layers)
    prompts = ragged_prompts(args.requests, args.max_prompt, model.config.vocab_size)
    ref, ref_s = generate(model, prompts, args.new_tokens, "paged|sdpa")
    ours, ours_s = generate(model, prompts, args.new_tokens, ours_impl)
    total = sum(len(t) for t, _ in ours.values())
    print(f"device: {torch.cuda.get_device_name()}; {args.requests} requests, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each")
    print(f"paged|sdpa      : {total / ref_s:9.1f} tokens/s ({ref_s:.2f} s)")
    print(f"{ours_impl}: {total / ours_s:9.1f} tokens/s ({ours_s:.2f} s), {ref_s / ours_s:.2f}x")
    print("comparison:", compare(model, prompts, ours, ref))


if __name__ == "__main__":
    main()
