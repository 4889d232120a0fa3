"""Decode with TrainStreamCache at several residencies and DynamicCache on one model; prints where the greedy
tokens part and the largest logit difference per step (a race shows as run-to-run differences of one setting).

    python scripts/diag_cache.py [--batch 8 --length 1024 --new 32 --layers 8 --hidden 512] [--out file.json]
"""
import argparse
import datetime
import inspect
import json
import shlex
import sys

import transformers

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, ".")
from trainstream_hf.cache import TrainStreamCache  # noqa: E402

KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def decode(model, ids, cache, new):
    logits, toks = [], []
    with torch.no_grad():
        out = model(input_ids=ids, **{KW: cache}, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        logits.append(out.logits[:, -1].float())
        toks.append(nxt)
        for _ in range(new - 1):
            out = model(input_ids=nxt, **{KW: cache}, use_cache=True)
            logits.append(out.logits[:, -1].float())
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
    torch.cuda.synchronize()
    return torch.cat(toks, 1), torch.stack(logits, 1)


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(batch=8, length=1024, new=32, layers=8, hidden=512, vocab=256).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--label", default="", help="what the tree under test is (e.g. 'before the fix')")
    a = ap.parse_args()
    rows = []
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=a.vocab, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, [3, 17]] *= 25
    ids = torch.randint(3, a.vocab, (a.batch, a.length), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    n = a.length + a.new
    runs = {"dynamic": lambda: DynamicCache(config=model.config)}
    for r in (1.0, 0.5, 0.0):
        runs[f"resident={r}"] = lambda r=r: TrainStreamCache(model, resident=r, slots=2, max_cache_len=n)
    base_t, base_l = decode(model, ids, runs["resident=1.0"](), a.new)
    for name, make in runs.items():
        for rep in range(2):
            t, l = decode(model, ids, make(), a.new)
            diff = (l - base_l).abs().amax(dim=(0, 2))
            first = (t != base_t).any(0).nonzero()
            print(f"{name:14s} run {rep}: tokens equal {torch.equal(t, base_t)}, first differing step "
                  f"{first[0].item() if len(first) else None}, max |dlogit| per step "
                  f"{[round(x, 4) for x in diff.tolist()[:8]]}... max {diff.max().item():.4g}", flush=True)
            rows.append({"cache": name, "run": rep, "tokens_equal": torch.equal(t, base_t),
                         "first_differing_step": first[0].item() if len(first) else None,
                         "max_abs_dlogit_per_step": [round(x, 5) for x in diff.tolist()]})
    if a.out:
        from trainstream_hf.provenance import git_commit

        commit, dirty = git_commit(".")
        with open(a.out, "w") as f:
            json.dump({"command": shlex.join(["python", *sys.argv]), "label": a.label, "commit": commit,
                       "dirty": dirty, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "transformers": transformers.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "args": vars(a), "reference": "resident=1.0, first run", "rows": rows}, f, indent=1)


if __name__ == "__main__" and sys.argv[1:2] != ["one"]:
    main()


def one_step(batch=8, length=1024, layers=8, hidden=512, vocab=256):
    """Prefill + one decode step fed the same token to DynamicCache and a fully offloaded cache: per layer, where
    the host pages part from DynamicCache's K/V, and the step's logit difference."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=vocab, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    ids = torch.randint(3, vocab, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    nxt = ids[:, -1:]
    out = {}
    for name, cache in (("dynamic", DynamicCache(config=model.config)),
                        ("paged", TrainStreamCache(model, resident=0.0, slots=2, max_cache_len=length + 8))):
        with torch.no_grad():
            model(input_ids=ids, **{KW: cache}, use_cache=True, logits_to_keep=1)
            logits = model(input_ids=nxt, **{KW: cache}, use_cache=True).logits[:, -1].float()
        torch.cuda.synchronize()
        out[name] = (cache, logits)
    (dyn, ld), (pg, lp) = out["dynamic"], out["paged"]
    pg._sync()
    print("step logits max diff", (ld - lp).abs().max().item())
    for i, layer in enumerate(pg.layers):
        k = layer.k[:length + 1].permute(1, 2, 0, 3).cuda()
        bad = (k != dyn.layers[i].keys).any(dim=(0, 1, 3)).nonzero().flatten()
        print(f"layer {i}: k tokens differing {bad.numel()} {bad[:5].tolist()} {bad[-3:].tolist()}")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "one":
    one_step()
