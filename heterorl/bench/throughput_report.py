"""``heterorl bench throughput``'s printed report: the side-by-side tables of its parts."""

from __future__ import annotations


def _cells(r: dict, keys: tuple[str | None, ...], fmt: str, width: int) -> str:
    return "".join((fmt.format(r[k]) if k is not None and k in r else "—").rjust(width) for k in keys)


def report(res: dict, args) -> str:
    lines = [
        f"throughput: {args.prompts} prompts × {args.group_size} completions, "
        f"≤ {args.max_new_tokens} new tokens, temperature 1; model {res['model']} "
        f"({res['parameters']:,} parameters); prompts: {res['prompts']}; {res['threads']} torch threads"
    ]
    if "rollout" in res:
        r, w = res["rollout"], 15
        sides = ("vllm_backend", "hf_backend", "plain_generate", "trl_generate")
        lines += [
            "",
            "rollout (real completion tokens)".ljust(32)
            + "".join(h.rjust(w) for h in ("vllm backend", "hf backend", "model.generate", "TRL generate")),
            "tokens/s".ljust(32) + _cells(r, tuple(f"{s}_tokens_per_s" for s in sides), "{:.1f}", w),
            "mean completion length".ljust(32)
            + _cells(r, tuple(f"{s}_mean_length" for s in sides), "{:.1f}", w),
            "ratio vs TRL generate".ljust(32)
            + _cells(r, ("ratio_vllm_vs_trl", "ratio_hf_vs_trl", None, None), "{:.2f}×", w),
            "ratio vs model.generate".ljust(32)
            + _cells(r, ("ratio_vllm_vs_plain", "ratio_hf_vs_plain", None, None), "{:.2f}×", w),
        ]
        if "ratio_vllm_vs_hf" in r:
            lines.append(f"vllm backend vs hf backend: {r['ratio_vllm_vs_hf']:.2f}× ({r['vllm_describe']})")
        else:
            lines.append(f"vllm backend: not measured ({r.get('vllm_skipped')})")
    if "switch" in res:
        s = res["switch"]
        if "skipped" in s:
            lines += ["", f"weight switch: not measured ({s['skipped']})"]
        else:
            lines += [
                "",
                f"weight switch in the running vLLM engine (median of {len(s['restart_all_s'])}): "
                f"load_weights {s['load_weights_s']:.3f} s vs engine restart {s['restart_s']:.1f} s "
                f"-> {s['ratio_restart_vs_load_weights']:.0f}× faster",
                f"  (first engine start {s['engine_start_s']:.1f} s; a restart-based switch also writes the "
                f"{s['weight_bytes'] / 1e6:.0f} MB of weights first: {s['save_safetensors_s']:.3f} s)",
            ]
    if "learner" in res:
        r = res["learner"]
        lines += [
            "",
            f"learner tokens/s: GEPO update {r['learner_tokens_per_s']:.1f}, plain CE step "
            f"{r['plain_ce_tokens_per_s']:.1f}  -> {r['ratio_learner_vs_plain_ce']:.2f}× "
            f"({r['completion_tokens_per_update']:.0f} completion tokens in {r['rows_per_update']} rows per "
            f"update, {r['micro_batches']} micro-batch(es))",
        ]
    if "rl" in res:
        r, w = res["rl"], 17
        cols = ("ours_grpo", "ours_gepo", "ours_grpo_vllm")
        lines += [
            "",
            "RL steps (steady)".ljust(27)
            + "".join(
                h.rjust(w) for h in ("ours-grpo hf", "ours-gepo hf", "ours-grpo vllm", "TRL GRPOTrainer")
            ),
            "steps/s".ljust(27)
            + _cells(r, (*(f"{c}_steps_per_s" for c in cols), "trl_grpo_steps_per_s"), "{:.3f}", w),
            "mean completion length".ljust(27)
            + _cells(r, (*(f"{c}_mean_length" for c in cols), "trl_mean_length"), "{:.1f}", w),
            "ratio vs TRL".ljust(27) + _cells(r, (*(f"ratio_{c}_vs_trl" for c in cols), None), "{:.2f}×", w),
        ]
        if "vllm_skipped" in r:
            lines.append(f"ours-grpo vllm: not measured ({r['vllm_skipped']})")
    if "swarm" in res:
        r = res["swarm"]
        single = r["single_process_trajectories_per_s"]
        lines += ["", f"swarm trajectories/s (learner intake); single-process loop {single:.0f}"]
        for k in args.samplers:
            w = r[f"swarm{k}"]
            lines.append(
                f"  {k} sampler(s): {w['trajectories_per_s']:6.0f}/s = {r[f'ratio_swarm{k}_vs_single']:.2f}× "
                f"single; learner waits {w['wait_frac']:.0%}, trains {w['train_frac']:.0%}; "
                f"staleness {w['staleness_mean']:.1f}"
            )
            lines.append(
                f"      publishing: training blocked {w['publish_frac']:.1%} of learner time; in the "
                f"background: save {w['save_frac']:.0%}, build {w['build_frac']:.0%}, "
                f"announce {w['announce_frac']:.0%} (CPU {w.get('publisher_cpu_frac', 0):.0%}); "
                f"{w['published_frac']:.0%} of versions published"
            )
            if "overhead_s_per_update" in w:
                lines.append(
                    f"      per update: forward+backward {w['fwd_bwd_s_per_update'] * 1e3:.1f} ms, "
                    f"everything else but waiting {w['overhead_s_per_update'] * 1e3:.1f} ms"
                )
    return "\n".join(lines)
