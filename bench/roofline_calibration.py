"""Calibrate the roofline on this machine: predict the embedded model's CPU round time from measured CPU
bandwidth and FLOP rate (kimi_jax.analysis.roofline.calibrate_cpu) and compare with the measured round time.

    python -m bench.roofline_calibration [--new-tokens 64] [--budgets 0,16,64]

Budget 0 is plain AR (one token per round); other budgets are DDTree rounds (verify width budget + 1, plus the
drafter). Weights are float32 on the CPU except the INT4 experts. Writes bench/results/roofline_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None):
    import kimi_jax
    from kimi_jax.analysis import roofline
    from kimi_jax.training.corpus import heldout_prompts
    p = argparse.ArgumentParser(prog="python -m bench.roofline_calibration")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budgets", default="0,16,64")
    a = p.parse_args(argv)
    model = kimi_jax.load(str(ROOT / "checkpoints" / "target"), drafter=str(ROOT / "checkpoints" / "drafter"))
    model = kimi_jax.Model(model.config.replace(eos_token_ids=()), model.params, model.tokenizer, model.drafter)
    prompt = heldout_prompts(model.tokenizer, 1, 64)
    cpu = roofline.calibrate_cpu()
    d = model.drafter.config
    drafter = roofline.DrafterSpec(layers=d.num_hidden_layers, hidden=d.hidden_size, heads=d.num_attention_heads,
                                   kv_heads=d.num_key_value_heads, head_dim=d.head_dim,
                                   intermediate=d.intermediate_size, n_taps=len(d.target_layer_ids),
                                   target_hidden=model.config.hidden_size,
                                   block_size=d.block_size)
    rows = []
    for budget in (int(b) for b in a.budgets.split(",")):
        method = "ar" if budget == 0 else "ddtree"
        model.generate(prompt, a.new_tokens, method=method, budget=budget or None)      # compile
        g = model.generate(prompt, a.new_tokens, method=method, budget=budget or None)
        measured = g.stats["seconds"] / g.stats["rounds"]
        est = roofline.predict_round_time(model.config, cpu, budget + 1, 64 + a.new_tokens // 2,
                                          weight_dtype_bytes=4, drafter=None if budget == 0 else drafter)
        rows.append(dict(method=method, budget=budget, measured_ms=measured * 1e3, predicted_ms=est.total_s * 1e3,
                         ratio=measured / est.total_s))
    print(f"cpu profile: copy bandwidth {cpu.mem_bw / 1e9:.1f} GB/s, float32 matmul {cpu.bf16_flops / 1e9:.1f} GFLOP/s")
    print(f"{'method':7s} {'budget':>6s} {'measured ms':>12s} {'roofline ms':>12s} {'measured/roofline':>18s}")
    for r in rows:
        print(f"{r['method']:7s} {r['budget']:6d} {r['measured_ms']:12.2f} {r['predicted_ms']:12.3f} {r['ratio']:18.1f}")
    out = ROOT / "bench" / "results" / "roofline_cpu.json"
    out.write_text(json.dumps({"cpu": {"copy_bw": cpu.mem_bw, "flops": cpu.bf16_flops}, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
