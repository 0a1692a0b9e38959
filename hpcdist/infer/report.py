"""``hpcdist report`` for inference results: the metrics and the generated text, with rich tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hpcdist.console import table, text
from hpcdist.store.results import read_attrs, read_table


def _ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1e3 * float(x):.2f} ms"


def render_infer_report(path: str | Path, max_outputs: int = 5) -> str:
    """A readable summary of an ``infer_gpt`` or ``broadcast`` result file."""
    import h5py

    path = Path(path)
    attrs = read_attrs(path)
    kind = attrs.get("kind")
    site = attrs.get("site")
    site_name = site.get("name") if isinstance(site, dict) else site
    lines = [f"{path}", f"  job {attrs.get('job_name')} ({kind}), id {attrs.get('job_id')}, site {site_name}, "
             f"{attrs.get('world_size')} ranks on {attrs.get('num_nodes')} node(s), created {attrs.get('created')}"]
    with h5py.File(path, "r") as f:
        if kind == "broadcast":
            t = read_table(f["broadcast"])
            lines.append(
                f"  broadcast of {int(attrs['bytes'])} bytes ({int(attrs['tensors'])} tensors in "
                f"{int(attrs['buckets'])} buckets of <= {attrs['bucket_mb']} MB)"
            )
            grid = table("iter", "time", "algbw GB/s", "busbw GB/s", "#wrong", left=0)
            for i in range(len(t["iter"])):
                grid.add_row(
                    str(int(t["iter"][i])), _ms(t["time_s"][i]), f"{t['algbw_gbps'][i]:.4f}",
                    f"{t['busbw_gbps'][i]:.4f}", str(int(t["wrong"][i])),
                )
            lines += text(grid, indent=2).splitlines()
            lines.append(f"  median busbw {attrs['busbw_median_gbps']:.4f} GB/s")
            return "\n".join(lines) + "\n"
        if kind != "infer_gpt":
            raise ValueError(f"{path} holds a {kind!r} result, not an inference result")
        s = dict(f["summary"].attrs)
        load = dict(f["load"].attrs)
        req = read_table(f["requests"])
        ranks = read_table(f["ranks"])
    cfg = json.loads(attrs["model_config_json"])
    sampling = json.loads(attrs["sampling_json"])
    lines.append(
        f"  checkpoint {attrs['checkpoint']} (step {attrs['checkpoint_step']}): {cfg['n_layer']} layers, "
        f"d_model {cfg['d_model']}, {cfg['n_head']} heads, {cfg['mlp']} MLP"
    )
    lines.append(f"  tensor parallel {attrs['tp']} x data parallel {attrs['dp']}; sampling {sampling}")
    method = load.get("method")
    if isinstance(method, bytes):
        method = method.decode()
    lines.append(
        f"  weights by {method}: {int(load['bytes'])} bytes in {float(load['seconds']):.4f} s "
        f"({float(load['algbw_gbps']):.3f} GB/s)"
    )
    lines.append(
        f"  {len(req['request'])} requests, {int(s['new_tokens'])} new tokens in {float(s['wall_s']):.3f} s: "
        f"{float(s['tokens_per_s']):.1f} tokens/s overall"
    )
    latency = table("latency", "p50", "p99")
    for name, label in (("ttft", "time to first token"), ("per_token", "per token"), ("step", "decode step"),
                        ("total", "total")):
        latency.add_row(label, _ms(s[f"{name}_p50_s"]), _ms(s[f"{name}_p99_s"]))
    per_rank = table("rank", "host", "tp", "dp", "requests", "tokens", "tokens/s", left=("host",))
    for i in range(len(ranks["rank"])):
        per_rank.add_row(
            str(int(ranks["rank"][i])), str(ranks["host"][i]), str(int(ranks["tp_rank"][i])),
            str(int(ranks["dp_group"][i])), str(int(ranks["requests"][i])), str(int(ranks["new_tokens"][i])),
            f"{float(ranks['tokens_per_s'][i]):.1f}",
        )
    lines += text(latency, indent=2).splitlines() + text(per_rank, indent=2).splitlines()
    for i in range(min(max_outputs, len(req["request"]))):
        lines.append(
            f"  [{int(req['request'][i])}] {str(req['prompt'][i])!r} -> {str(req['output'][i])!r} ({req['finish'][i]})"
        )
    if len(req["request"]) > max_outputs:
        lines.append(f"  ... {len(req['request']) - max_outputs} more in /requests")
    return "\n".join(lines) + "\n"
