"""eval.acceptance's outputs: the side-by-side table (terminal and Markdown) and the plot.

Pure functions of the results dict that :func:`eval.acceptance.evaluate` returns (one entry per
checkpoint), so the JSON written by ``--json`` can be rendered again without evaluating.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redraft.core.plotting import atomic_write_png, pyplot


def _rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    first = next(iter(results.values()))
    k_steps = first["settings"]["steps"]
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, fn) -> None:
        rows.append((label, [fn(r) for r in results.values()]))

    mode = "tree" if first["tree"] else "chain"
    walked = first["tau_estimator"] == "engine_walk"
    how = "engine walk, 1 + accepted/rounds" if walked else "expected per position, accepted + 1"
    add(f"tau ({mode}, {how})", lambda r: f"{r['tau']:.3f}")
    add("accepted drafts per round" if walked else "accepted drafts", lambda r: f"{r['accepted_drafts']:.3f}")
    for k in range(k_steps):
        add(f"P(accept) draft {k + 1}" + (" (per round)" if walked else ""),
            lambda r, k=k: f"{r['accept_rate'][k]:.3f}")
    if walked and not first["tree"]:
        for j in range(1, k_steps + 1):
            add(f"tau chain length {j}", lambda r, j=j: f"{r['tau_per_chain_length'][str(j)]:.3f}")
    if walked:
        add("requests / verify rounds", lambda r: f"{r['engine_walk']['requests']} / {r['engine_walk']['rounds']}")
        for name in first["engine_walk"]["tau_by_position"]:
            add(f"tau at positions {name} (rounds)", lambda r, name=name: _bucket(r, name))
    if first.get("sglang_request_accept_length") is not None:
        add("SGLang meta_info accept length", lambda r: f"{r['sglang_request_accept_length']:.3f}")
    if walked:
        add("diagnostic: per-position mean tau", lambda r: f"{r['per_position']['tau']:.3f}")
        if not first["tree"]:
            for k in range(k_steps):
                add(f"diagnostic: per-position rate {k + 1}",
                    lambda r, k=k: f"{r['per_position']['accept_rate'][k]:.3f}")
    if first["tree"]:
        add(f"diagnostic: chain tau per position (K={k_steps})", lambda r: f"{r['chain_tau']:.3f}")
    for g in ("source", "category"):
        keys = sorted({k for r in results.values() for k in r[f"by_{g}"]})
        for key in keys:
            add(f"tau {g}={key}", lambda r, g=g, key=key: (
                f"{r[f'by_{g}'][key]['tau']:.3f}" if key in r[f"by_{g}"] else "-"))
    add("drafting positions (diagnostic)", lambda r: str(r["tree"]["positions"] if r["tree"] else r["positions"]))
    add("samples / tokens", lambda r: f"{r['samples']} / {r['tokens']}")
    add("stopped: end / off-path", lambda r: (
        f"{r['stop_reasons']['end']:.3f} / {r['stop_reasons']['off_path']:.3f}"))
    add("evaluation", lambda r: r["evaluation"])
    add("assistant tokens = target argmax", lambda r: (
        f"{r['data_argmax_agreement']['agreeing']}/{r['data_argmax_agreement']['counted']}"))
    add("eval tokens/s", lambda r: f"{r['tokens_per_s']:.0f}")
    return rows


def _bucket(result: dict[str, Any], name: str) -> str:
    cell = result["engine_walk"]["tau_by_position"].get(name)
    if not cell or not cell["rounds"]:
        return "-"
    return f"{cell['tau']:.3f} ({cell['rounds']})"


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """Plain-text table, one column per checkpoint."""
    rows = _rows(results)
    names = list(results)
    w0 = max(len(label) for label, _ in rows)
    widths = [max(len(n), *(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
    lines = ["  ".join([" " * w0] + [n.rjust(w) for n, w in zip(names, widths, strict=True)])]
    lines.append("  ".join(["-" * w0] + ["-" * w for w in widths]))
    for label, vals in rows:
        lines.append("  ".join([label.ljust(w0)] + [v.rjust(w) for v, w in zip(vals, widths, strict=True)]))
    first = next(iter(results.values()))
    lines.append("")
    lines.append(first["evaluation_note"])
    return "\n".join(lines)


def format_markdown(results: dict[str, dict[str, Any]]) -> str:
    rows = _rows(results)
    names = list(results)
    lines = ["| metric | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    lines += ["| " + label + " | " + " | ".join(vals) + " |" for label, vals in rows]
    first = next(iter(results.values()))
    lines += ["", f"_{first['evaluation_note']}_", ""]
    return "\n".join(lines)


def write_plot(results: dict[str, dict[str, Any]], path: str | Path) -> None:
    """Two panels: acceptance rate per draft position, and tau against chain length; checkpoints side by side."""
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        ks = list(range(1, len(r["accept_rate"]) + 1))
        a.plot(ks, r["accept_rate"], marker="o", label=name)
        b.plot(ks, [r["tau_per_chain_length"].get(str(k), float("nan")) for k in ks], marker="o", label=name)
    a.set(xlabel="draft position", ylabel="P(draft accepted)", title="acceptance per draft position", ylim=(0, 1))
    b.set(xlabel="chain length (steps)", ylabel="tau (accepted + 1)", title="tau against steps")
    from matplotlib.ticker import MaxNLocator

    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_png(fig, path)
