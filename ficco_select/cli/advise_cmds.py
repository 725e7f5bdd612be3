"""`ficco advise`: what to set in Megatron/TransformerEngine, vLLM or torchtitan for a model's
layers on a machine, from the exported selector's decisions (``ficco_select.train.advise``)."""

from __future__ import annotations

import dataclasses

import click

from ficco_select.cli.output import json_option, refuse_existing_out, reported, show

FORMATS = ("te", "vllm", "torchtitan")
SWITCH_SOURCES = {"te": ("nccl", "te"), "vllm": ("nccl", "vllm", "torch"), "torchtitan": ("nccl", "torch")}
"""Whose source each format's switch advice is read from (``advise_switch.SOURCES``)."""


@click.command("advise")
@click.option("--model", "model_name", default=None,
              help="A catalog model (data/models.csv, e.g. llama3-70b); or give --hidden, --ffn, --heads, --layers.")
@click.option("--hidden", type=int, default=None)
@click.option("--ffn", type=int, default=None, help="MLP inner width.")
@click.option("--heads", type=int, default=None)
@click.option("--kv-heads", type=int, default=None, help="Key/value heads (default: --heads).")
@click.option("--layers", type=int, default=None)
@click.option("--gated/--not-gated", default=True, show_default=True, help="Gated MLP (fc1 holds gate and up).")
@click.option("--tp", type=int, required=True, help="Tensor-parallel size.")
@click.option("--seq", type=int, required=True, help="Sequence length.")
@click.option("--micro-batch", type=int, default=1, show_default=True)
@click.option("--context-parallel", type=int, default=1, show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp8"]), default="bf16", show_default=True)
@click.option("--sequence-parallel/--no-sequence-parallel", default=True, show_default=True)
@click.option("--hardware", required=True,
              help="A preset (h100-nvswitch), a data-sheet machine, a spec file, or a machine the selector carries.")
@click.option("--selector", "selector_path", type=click.Path(file_okay=False), default=None,
              help="An exported selector (`ficco export`); refused if it cannot be read. Default: the exported "
                   "champion ($FICCO_SELECTOR or ~/.cache/ficco-select/selector) if there is one, else the heuristic.")
@click.option("--heuristic-only", is_flag=True, help="No model: the hand heuristic decides every GEMM.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True,
              help="te: a userbuffers YAML for Megatron's --tp-comm-overlap-cfg and its flags; vllm: the token "
                   "count below which overlap does not pay, with the flags; torchtitan: async TP on or off.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="With --format te: write the YAML here (default: print it); an existing file is refused.")
@json_option("Print the advice and where each decision came from as JSON.")
def advise(model_name, hidden, ffn, heads, kv_heads, layers, gated, tp, seq, micro_batch, context_parallel, dtype,
           sequence_parallel, hardware, selector_path, heuristic_only, fmt, out, as_json) -> None:
    """What to set in each framework for a model's layers on a machine, from the selector."""
    from ficco_select.runtime.selector import Selector
    from ficco_select.train import advise as A
    from ficco_select.train import advise_switch as S

    if out is not None:
        if fmt != "te":
            raise click.UsageError("--out writes the userbuffers YAML of --format te")
        refuse_existing_out(out, {"--hardware": [hardware], "--selector": [selector_path]})
    with reported(ValueError):
        model = _model(model_name, hidden, ffn, heads, kv_heads, layers, gated)
        layout = A.Layout(tp=tp, seq=seq, micro_batch=micro_batch, dtype=dtype, sequence_parallel=sequence_parallel,
                          context_parallel=context_parallel)
        A.check(model, layout)
        if not sequence_parallel and fmt in ("te", "torchtitan"):
            raise ValueError(f"--format {fmt}: its tensor-parallel overlap runs on sequence-parallel activations "
                             "(Megatron asserts --sequence-parallel; torchtitan's async TP gathers sequence shards)")
    selector = _selector(selector_path, heuristic_only)
    spec = selector.machine(hardware)
    if spec is None:
        raise click.ClickException(f"--hardware {hardware}: not a preset, a data-sheet machine, a spec file or a "
                                   "machine the selector carries")
    with reported(ValueError):
        A.check_machine(layout, spec)
    decisions = A.decide(selector.select, model, layout, hardware)
    result = {"model": dataclasses.asdict(model), "layout": dataclasses.asdict(layout) | {"tokens": layout.tokens},
              "hardware": hardware, "selector": "heuristic" if heuristic_only else str(selector_path or "default"),
              "decisions": A.provenance(decisions),
              "measured_machine": selector.measured(hardware)}
    if fmt == "te":
        result["te"] = A.te_advice(decisions, model, layout, hardware, pick=A.cost_model_pick(spec))
        text = A.te_yaml(result["te"], _te_header(result))
        if out:
            with open(out, "x") as f:  # refused above if it exists; "x": nor if it appeared since
                f.write(text)
        lines = ([] if out else [text.rstrip()]) + _flag_lines(result["te"], out)
        switch = S.te_switch(decisions, result["te"], model, layout)
    elif fmt == "vllm":
        result["vllm"] = (A.vllm_advice(selector.select, model, layout, hardware) if sequence_parallel else
                          {"thresholds": {}, "sp_min_token_num": None, "flags": [],
                           "notes": ["without sequence parallelism vLLM's pass has nothing to overlap"]})
        lines = _vllm_lines(result["vllm"])
        switch = S.vllm_switch(selector.select, model, layout, hardware, result["vllm"]["sp_min_token_num"])
    else:
        result["torchtitan"] = A.torchtitan_advice(selector.select, model, layout, hardware)
        lines = _torchtitan_lines(result["torchtitan"])
        switch = S.torchtitan_switch(decisions, model, layout, result["torchtitan"]["async_tp"])
    result["switch"] = S.as_json(switch)  # GEMMs decided *.switch only: none where the spec has no switch_reduce
    if switch:
        result["switch_sources"] = {k: S.SOURCES[k] for k in SWITCH_SOURCES[fmt]}
    lines += [a.line() for a in switch]
    measured = (["the model learned this machine's own measured rows: the GPU rule steps aside"]
                if result["measured_machine"] else [])
    show(as_json, result, lambda: [*lines, *_source_lines(result["decisions"]), *measured])


def _selector(path, heuristic_only: bool):
    """The heuristic alone, the export the user named (refused, in one line, if it cannot be
    read: the user asked for that model, not for the heuristic), or the default one."""
    from ficco_select.runtime.loading import read_export
    from ficco_select.runtime.selector import Selector

    if heuristic_only:
        if path is not None:
            raise click.UsageError("--heuristic-only asks for no model: drop --selector")
        return Selector()
    if path is not None:
        try:
            _, meta, model = read_export(path)
            Selector(model, meta)  # checks every field of its rules, as loading does
        except (OSError, ValueError, TypeError, KeyError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise click.ClickException(f"--selector {path}: no usable exported selector there ({why}); export one "
                                       "with `ficco export`, or pass --heuristic-only") from None
    return Selector.load(path)


def _model(name, hidden, ffn, heads, kv_heads, layers, gated):
    from ficco_select.train.advise import Model

    shape = (hidden, ffn, heads, layers)
    if name is not None:
        if any(v is not None for v in (*shape, kv_heads)):
            raise ValueError("--model names a catalog model: drop --hidden, --ffn, --heads, --kv-heads and --layers")
        return Model.from_catalog(name)
    if any(v is None for v in shape):
        raise ValueError("give --model NAME, or all of --hidden, --ffn, --heads and --layers")
    return Model.custom(hidden=hidden, ffn=ffn, heads=heads, layers=layers, kv_heads=kv_heads, gated=gated)


def _te_header(result: dict) -> list[str]:
    m, lay = result["model"], result["layout"]
    return [f"ficco advise --format te: {m['name']} (hidden {m['hidden']}, ffn {m['ffn']}), TP {lay['tp']}, "
            f"seq {lay['seq']} x micro-batch {lay['micro_batch']}, {lay['dtype']}, on {result['hardware']}",
            "Megatron: --tp-comm-overlap-cfg <this file>; TransformerEngine initialize_ub(ub_cfgs=...)",
            "bulk GEMMs (qkv/fc1 dgrad and wgrad): TE's defaults, not decided by ficco"]


def _flag_lines(te: dict, out) -> list[str]:
    if not te["overlap"]:
        return te["notes"]
    flags = " ".join(te["megatron_flags"]).replace("<this file>", out or "<this file>")
    lines = [f"megatron: {flags}"]
    lines += [f"model parallel config: {k}={v}" for k, v in te["model_parallel_config"].items()]
    return lines + [f"note: {n}" for n in te["notes"]]


def _vllm_lines(v: dict) -> list[str]:
    lines = [f"{kind}: overlap pays from {t} tokens" if t is not None else f"{kind}: overlap pays at no token count"
             for kind, t in v["thresholds"].items()]
    if v["sp_min_token_num"] is not None:
        lines.append(f"vllm serve <model> {' '.join(_quoted(f) for f in v['flags'])}")
    return lines + [f"note: {n}" for n in v["notes"]]


def _torchtitan_lines(t: dict) -> list[str]:
    return [f"async TP: {'on' if t['async_tp'] else 'off'} (overlap pays for {t['share_at_tokens']:.0%} of a "
            f"layer's GEMMs at {t['tokens']} tokens, {t['share_over_grid']:.0%} over 16..65536 tokens)",
            f"torchtitan: {' '.join(t['flags'])}", *(f"note: {n}" for n in t["notes"])]


def _source_lines(decisions: dict) -> list[str]:
    by = ", ".join(f"{k} {v}" for k, v in sorted(decisions["by_source"].items()))
    lines = [f"decided by: {by}" + (f" (the GPU rule vetoed {decisions['gpu_rule']})" if decisions["gpu_rule"] else "")]
    return lines + [f"  {name}: {d['schedule']} ({d['source']}{': ' + d['reason'] if d['reason'] else ''})"
                    for name, d in decisions["per_gemm"].items()]


def _quoted(text: str) -> str:
    import shlex

    return shlex.quote(text)


COMMANDS = [advise]
