"""`harness select`: the search, the memory terms, the odds and the constraints (predicted; nothing runs)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import pytest

from backends import all_backends, get_backend
from core.config import InvalidConfig, RunConfig
from core.records import validate_record
from harness.arguments import run_argv
from harness.arguments.parsers import gpu_range
from harness.cli import main, make_parser
from harness.predict import memory
from harness.predict.hardware import CORNERS, load_profile
from harness.predict.model import BAND_INPUTS, step_at
from harness.run.options import build_config
from harness.select import search as select
from harness.select.command import EXIT_NOTHING
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit


def cfg(backend="torch-ddp", n=2, micro=4, ckpt=False, options=None, workload="small") -> RunConfig:
    return RunConfig.build(
        backend=backend,
        workload=workload,
        spec=PRESETS[workload],
        world_size=n,
        device="cuda",
        precision="bf16",
        micro_batch=micro,
        activation_checkpointing=ckpt,
        nodes=1,
        gpus_per_node=n,
        backend_options=get_backend(backend).Options(**(options or {})).to_dict(),
    )


def test_gpu_range():
    assert gpu_range("8-256") == [8, 16, 32, 64, 128, 256]
    assert gpu_range("32,8,16") == [8, 16, 32]
    for bad in ("x", "0", "16-8", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_range(bad)


def test_sharding_settings_come_from_the_options():
    assert [s["zero_stage"] for s in select.sharding_settings(get_backend("deepspeed"))] == [0, 1, 2, 3]
    # Paddle's stage 0, plain data parallel, is its default and a choice of --sharding-stage: searched
    paddle = select.sharding_settings(get_backend("paddle-fleet"))
    assert [s["sharding_stage"] for s in paddle] == [0, 1, 2, 3]
    assert select.sharding_settings(get_backend("torch-ddp")) == [{}]
    for backend in all_backends():  # every stack's default is searched
        defaults = backend.Options().to_dict()
        settings = select.sharding_settings(backend)
        assert any(all(defaults[k] == v for k, v in setting.items()) for setting in settings), backend.name


# ----------------------------------------------------------------------------------------- memory terms
TERMS = ("model_state", "gathered_parameters", "comm_buffers", "activations", "materialised_attention")


def test_total_is_every_term():
    mem = memory.peak_memory(cfg("torch-fsdp"))
    assert set(mem) == {*TERMS, "total"}
    assert mem["total"] == pytest.approx(sum(mem[t] for t in TERMS))


def test_model_state_holds_deepspeeds_fp32_copy():
    """ZeRO-0 in bf16: bf16 weights and gradients, fp32 master and two moments: at least 16 B a parameter."""
    c = cfg("deepspeed", options={"zero_stage": 0})
    assert memory.peak_memory(c)["model_state"] >= 16 * c.model.spec.n_params


def test_sharded_stacks_gather_and_replicated_ones_bucket():
    fsdp, ddp = memory.peak_memory(cfg("torch-fsdp")), memory.peak_memory(cfg("torch-ddp"))
    assert fsdp["gathered_parameters"] > 0 and fsdp["comm_buffers"] == 0
    assert ddp["comm_buffers"] >= 4 * cfg().model.spec.n_params and ddp["gathered_parameters"] == 0


def test_activations_grow_with_micro_batch_and_shrink_with_checkpointing():
    a = [
        memory.peak_memory(cfg(micro=m, ckpt=k))["activations"]
        for m, k in ((2, False), (4, False), (4, True))
    ]
    assert a[1] == pytest.approx(2 * a[0]) and 0 < a[2] < a[1]


def test_tf_materialises_attention_and_the_others_do_not():
    small = PRESETS["small"]
    tf = memory.peak_memory(cfg("tf-mwms", micro=4))
    assert tf["materialised_attention"] == 4 * small.n_heads * small.seq_len**2 * 4 * small.n_layers
    assert memory.peak_memory(cfg("torch-ddp"))["materialised_attention"] == 0


def test_a_candidate_that_does_not_fit_names_the_term_that_broke_it():
    mem = memory.peak_memory(cfg("tf-mwms", micro=4))
    # usable just below the total: the last term (attention) is the one that passes it
    capacity = (mem["total"] - 1) / (1 - memory.ALLOCATOR_MARGIN)
    why = memory.fit_check(mem, capacity)
    assert why.startswith("materialised attention")
    assert memory.fit_check(mem, (mem["total"] + 1) / (1 - memory.ALLOCATOR_MARGIN)) is None
    # the margin is applied: the total alone fits the device, not the device less the margin
    assert memory.fit_check(mem, mem["total"] * 1.01) is not None


# ---------------------------------------------------------------------------------------------- search
def args_for(**kw):
    base = dict(
        workload="small", gpus=[8, 16], global_batch=64, deadline=None, budget=None, threads_per_worker=1
    )
    base.update(kw)
    return argparse.Namespace(**base)


def largest_that_fits(c: RunConfig, capacity: float) -> int | None:
    """Worked out apart from search(): each micro-batch of 1, 2, 4, ..., 64 that divides the rank's share of
    the global batch, its peak held to the device less the allocator margin; the largest, or None."""
    share = c.batch.micro_batch * c.batch.grad_accum
    usable = capacity * (1 - memory.ALLOCATOR_MARGIN)
    fitting = [
        m
        for m in (2**k for k in range(7))
        if share % m == 0
        and memory.peak_memory(c.evolve(micro_batch=m, grad_accum=share // m))["total"] <= usable
    ]
    return max(fitting, default=None)


def test_search_takes_the_largest_micro_batch_that_fits_and_drops_the_rest():
    profile = load_profile("h100-sxm")
    pricing = select.Pricing(profile)
    base, unpriced = select.base_configs(
        args_for(), pricing, PRESETS["small"], ["bf16"], ["torch-ddp", "deepspeed"]
    )
    assert not unpriced
    assert {(c.backend, c.topology.world_size) for c in base} == {
        (b, n) for b in ("torch-ddp", "deepspeed") for n in (8, 16)
    }
    roomy = select.search(base, pricing, 1e9, None)
    for c in roomy:
        assert not c.dropped
        assert c.cfg.batch.micro_batch * c.cfg.batch.grad_accum * c.cfg.topology.world_size == 64
        assert c.cfg.batch.micro_batch == largest_that_fits(c.cfg, profile.memory_bytes), c.label
    zero3 = next(
        c
        for c in roomy
        if c.cfg.backend_options.get("zero_stage") == 3
        and not c.cfg.model.activation_checkpointing
        and c.cfg.topology.world_size == 8
    )
    assert zero3.cfg.batch.micro_batch == 8  # all of its share fits on an H100

    # devices that hold ZeRO-3's micro-batch of 2 at most, then of 1 (its share is 8 at N = 8), and DDP's none
    for largest in (2, 1):
        peak = memory.peak_memory(zero3.cfg.evolve(micro_batch=largest, grad_accum=8 // largest))["total"]
        capacity = (peak + 1) / (1 - memory.ALLOCATOR_MARGIN)
        cands = select.search(
            base, select.Pricing(dataclasses.replace(profile, memory_bytes=capacity)), 1e9, None
        )
        for c in cands:
            expected = largest_that_fits(c.cfg, capacity)
            if expected is None:
                assert c.lacks == ["memory"] and "does not fit" in c.dropped, c.label
            else:
                assert not c.dropped and c.cfg.batch.micro_batch == expected, c.label
                assert c.cfg.batch.micro_batch * c.cfg.batch.grad_accum * c.cfg.topology.world_size == 64
        same = next(
            c
            for c in cands
            if c.label == zero3.label
            and c.cfg == zero3.cfg.evolve(micro_batch=largest, grad_accum=8 // largest)
        )
        assert not same.dropped
        ddp = [c for c in cands if c.cfg.backend == "torch-ddp" and not c.cfg.model.activation_checkpointing]
        assert ddp and all(c.lacks == ["memory"] for c in ddp)


def priced(price: float) -> list[select.Candidate]:
    pricing = select.Pricing(load_profile("h100-sxm"))
    base, _ = select.base_configs(args_for(), pricing, PRESETS["small"], ["bf16"], ["torch-ddp"])
    return select.search(base, pricing, 1e9, price)


def test_the_pareto_front_is_what_nothing_beats_on_both_time_and_cost():
    price = 2.0
    cands = priced(price)
    cost = {}
    for c in cands:  # the cost is GPU-hours at the price, worked out apart
        cost[id(c)] = c.prediction["corners"]["nominal"]["cost_usd"]
        assert cost[id(c)] == pytest.approx(c.train_s * c.cfg.topology.world_size / 3600 * price)

    def beats(o: select.Candidate, c: select.Candidate) -> bool:
        at_least = o.train_s <= c.train_s and cost[id(o)] <= cost[id(c)]
        return at_least and (o.train_s < c.train_s or cost[id(o)] < cost[id(c)])

    front = select.pareto(cands)
    assert front == [c for c in cands if not any(beats(o, c) for o in cands if o is not c)]
    # the trade-off is there to find: 16 GPUs are faster, 8 cheaper (scaling costs efficiency), both on it
    fastest, cheapest = min(cands, key=lambda c: c.train_s), min(cands, key=lambda c: cost[id(c)])
    assert fastest.cfg.topology.world_size == 16 and cheapest.cfg.topology.world_size == 8
    assert fastest in front and cheapest in front
    assert any(c not in front for c in cands)


def test_the_deadline_and_the_budget_drop_exactly_what_misses_them():
    cands = priced(2.0)
    times = sorted(c.train_s for c in cands)
    deadline_s = (times[0] + times[1]) / 2  # the fastest alone meets it
    select.constrain(cands, deadline_h=deadline_s / 3600, budget=None)
    assert [c for c in cands if not c.dropped] == [c for c in cands if c.train_s <= deadline_s]
    assert all(c.lacks == ["deadline"] and "misses the deadline" in c.dropped for c in cands if c.dropped)

    cands = priced(2.0)
    costs = sorted(c.prediction["corners"]["nominal"]["cost_usd"] for c in cands)
    budget = (costs[0] + costs[1]) / 2  # the cheapest alone is within it
    select.constrain(cands, deadline_h=None, budget=budget)
    kept = [c for c in cands if not c.dropped]
    assert kept == [c for c in cands if c.prediction["corners"]["nominal"]["cost_usd"] <= budget]
    assert len(kept) == 1 and all(c.lacks == ["budget"] for c in cands if c.dropped)


# ------------------------------------------------------------------------------------------ confirming
@pytest.mark.parametrize(
    "stacks, n, device, precision",
    [
        (["torch-ddp", "deepspeed", "torch-fsdp", "horovod"], 8, "cuda", "bf16"),
        (["tf-mwms", "paddle-fleet"], 2, "cpu", "fp32"),
    ],
)
def test_each_candidate_s_run_arguments_build_the_configuration_it_was_priced_as(
    stacks, n, device, precision
):
    """--confirm runs a candidate with `harness run RUN_ARGV`: parsed and built as a run builds it, that
    is the candidate's own configuration (stack, options beyond the variant's, variant, shape, precision,
    micro-batch and accumulation, checkpointing, ranks), for every sharding setting and variant."""
    profile = dataclasses.replace(load_profile("h100-sxm"), device=device)
    args = args_for(gpus=[n], workload="tiny", global_batch=32)
    base, _ = select.base_configs(args, select.Pricing(profile), PRESETS["tiny"], [precision], stacks)
    assert {c.variant for c in base} == {"default", "tuned"} and {
        c.model.activation_checkpointing for c in base
    } == {
        False,
        True,
    }
    runnable = 0
    for c in base:
        try:  # as search() drops what its adapter refuses (Paddle's sharding stages 2 and 3 on a CPU)
            get_backend(c.backend).validate(c)
        except InvalidConfig:
            continue
        runnable += 1
        c = c.evolve(micro_batch=2, grad_accum=c.batch.grad_accum // 2)
        parsed = make_parser().parse_args(["run", *run_argv(c)])
        built = build_config(parsed, c.backend, n, check_devices=False)
        for part in ("backend", "variant", "backend_options"):
            assert getattr(built, part) == getattr(c, part), (part, run_argv(c))
        assert built.model.spec == c.model.spec and built.model.precision == c.model.precision
        assert built.model.activation_checkpointing == c.model.activation_checkpointing
        assert (built.batch.micro_batch, built.batch.grad_accum) == (c.batch.micro_batch, c.batch.grad_accum)
        assert (built.topology.world_size, built.topology.device) == (n, device)
    assert runnable >= len(base) // 2


# ------------------------------------------------------------------------------------------------ odds
def candidate(c: RunConfig) -> select.Candidate:
    return select.Candidate(c, get_backend(c.backend).label(c), {})


def test_identical_candidates_are_each_about_half():
    c = cfg("torch-ddp", n=8)
    p = select.odds([candidate(c), candidate(c)], select.Pricing(load_profile("h100-sxm")), samples=200)
    assert p == pytest.approx([0.5, 0.5], abs=0.05)


def test_two_frameworks_whose_bands_overlap_are_not_ranked_as_if_apart():
    """torch-ddp and tf-mwms at 8 H100s: each framework's unknown MFU is its own, so neither wins every draw
    (drawn jointly, one would: the same corner for both keeps their order)."""
    pricing = select.Pricing(load_profile("h100-sxm"))
    cands = [candidate(cfg("torch-ddp", n=8)), candidate(cfg("tf-mwms", n=8))]
    p = select.odds(cands, pricing, samples=200)
    assert 0.05 < p[0] < 0.95 and sum(p) == pytest.approx(1.0), p


def test_a_candidate_faster_in_every_draw_wins_every_draw():
    """DDP at micro-batch 8 against 4: the same gradient all-reduce a step over twice the tokens. Both are
    torch (one compute draw), so each draw puts the two at the same corners: the premise is checked at every
    combination of corners, and the faster must then take every draw, wherever it stands in the list."""
    pricing = select.Pricing(load_profile("h100-sxm"))
    slow, fast = cfg("torch-ddp", n=8), cfg("torch-ddp", n=8, micro=8)
    profile = pricing.profile("torch-ddp")
    plans = [(c, pricing.calibration(c), get_backend(c.backend).schedule(c)) for c in (fast, slow)]
    for combo in itertools.product(CORNERS, repeat=len(BAND_INPUTS)):
        at = dict(zip(BAND_INPUTS, combo))
        per_token = [
            step_at(c, profile, calib, plan, at)["step_s"] / c.tokens_per_step for c, calib, plan in plans
        ]
        assert per_token[0] < per_token[1], at
    assert list(select.odds([candidate(slow), candidate(fast)], pricing, samples=100)) == [0.0, 1.0]
    assert list(select.odds([candidate(fast), candidate(slow)], pricing, samples=100)) == [1.0, 0.0]
    # beside a third stack the slow one still never wins, and the odds sum to one
    zero3 = cfg("deepspeed", n=8, options={"zero_stage": 3})
    p = select.odds([candidate(zero3), candidate(fast), candidate(slow)], pricing, samples=100)
    assert p[2] == 0.0 and sum(p) == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------- CLI
TINY_ON_H100 = ["select", "--workload", "tiny", "--hardware", "h100-sxm"]


@pytest.mark.subprocess  # the record's git commit
def test_cli_writes_a_selection_record_that_validates(tmp_path, capsys):
    code = main(
        [
            *TINY_ON_H100, "--gpus", "8,16", "--global-batch", "64", "--stacks", "torch-ddp,torch-fsdp",
            "--gpu-hour-price", "2", "--out", str(tmp_path),
            "--markdown", str(tmp_path / "select.md"), "--html", str(tmp_path / "select.html"),
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "SELECTED (predicted, not measured)" in out and "Pareto front" in out
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert validate_record(record) == "selection"
    first = record["ranked"][0]
    assert first["p_fastest"] is not None
    times = [r["train_time_s"]["nominal"] for r in record["ranked"]]
    assert times == sorted(times)
    # the documents answer first: the fastest with its odds, then who it is not told apart from, the cheapest
    md = (tmp_path / "select.md").read_text().splitlines()
    assert md[0] == "# distbench select" and md[2].startswith(f"Fastest (predicted): {first['label']}")
    assert f"P(fastest) {first['p_fastest']:.0%}" in md[2] and "Cheapest: " in "\n".join(md[:8])
    overlapping = [
        r for r in record["ranked"][1:] if r["train_time_s"]["low"] <= first["train_time_s"]["high"]
    ]
    assert ("Not told apart from it" in "\n".join(md[:8])) == bool(overlapping)
    html = (tmp_path / "select.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "Fastest (predicted)" in html and "<table>" in html


def test_cli_impossible_constraints_exit_1_naming_what_each_lacks(capsys):
    code = main(
        [*TINY_ON_H100, "--gpus", "8", "--global-batch", "64", "--stacks", "torch-ddp", "--deadline", "1e-9"]
    )
    assert code == EXIT_NOTHING
    out = capsys.readouterr().out
    assert "nothing meets the constraints" in out and "lacks deadline" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--hardware", "nope", "--gpus", "8"],
        ["--hardware", "h100-sxm", "--gpus", "8", "--stacks", "mxnet"],
        ["--hardware", "h100-sxm", "--gpus", "8", "--precision", "fp8"],
        ["--hardware", "h100-sxm", "--gpus", "8", "--budget", "10"],
    ],
)
def test_cli_malformed_input_exits_2_in_one_line(argv, capsys):
    assert main(["select", "--workload", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("harness: error:") and "\n" not in err


def test_cli_malformed_gpus_exit_2():
    assert main(["select", "--workload", "tiny", "--hardware", "h100-sxm", "--gpus", "x"]) == 2


# ---------------------------------------------------------------------------------- the documents' plots
def ranked(stacks=("torch-ddp", "torch-fsdp", "deepspeed"), price: float | None = 2.0):
    """The ranked rows of a search over `stacks`, as `harness select` writes them, and the candidates."""
    from harness.select.command import ranked_rows

    pricing = select.Pricing(load_profile("h100-sxm"))
    base, _ = select.base_configs(args_for(), pricing, PRESETS["small"], ["bf16"], list(stacks))
    kept = sorted(select.search(base, pricing, 1e9, price), key=lambda c: c.train_s)
    return ranked_rows(kept, select.pareto(kept), pricing), kept


def test_the_parts_table_holds_each_stacks_predicted_step_parts():
    from harness.select.presentation import parts_table

    rows, kept = ranked()
    table = parts_table(rows)
    firsts = {}
    for c in kept:  # each stack's fastest candidate, worked out apart
        firsts.setdefault(c.cfg.backend, c)
    assert [r[0] for r in table.rows] == [c.label for c in firsts.values()]
    for cells, c in zip(table.rows, firsts.values()):
        parts = c.prediction["timeline"]["parts"]
        step = c.prediction["corners"]["nominal"]["step_time_s"]
        assert sum(parts.values()) == pytest.approx(step)  # the parts carried are the whole step
        compute = sum(v for k, v in parts.items() if k.startswith("compute"))
        exposed = sum(v for k, v in parts.items() if k.startswith("exposed"))
        assert cells[3] == f"{compute * 1e3:,.2f} ms ({compute / step:.0%})"
        assert cells[4] == (f"{exposed * 1e3:,.2f} ms ({exposed / step:.0%})" if exposed else "-")
        assert cells[6] == f"{parts['stragglers (slowest of N)'] * 1e3:,.2f} ms " + (
            f"({parts['stragglers (slowest of N)'] / step:.0%})"
        )


def test_the_front_plot_draws_every_candidate_with_its_band_and_rings_the_front():
    import matplotlib.pyplot as plt

    from harness.select.presentation import front_plot, parts_plot

    rows, _ = ranked()
    fig = front_plot(rows)
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("cost (USD")
    lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["train_time_s"]["nominal"])
    assert list(lines["pareto front"].get_xdata()) == pytest.approx(
        [r["train_time_s"]["nominal"] / 3600 for r in front]
    )
    for stack in {r["backend"] for r in rows}:
        mine = [r for r in rows if r["backend"] == stack]
        drawn = [
            *(lines[f"front {stack}"].get_xdata() if f"front {stack}" in lines else []),
            *(lines[f"candidates {stack}"].get_xdata() if f"candidates {stack}" in lines else []),
        ]
        assert sorted(drawn) == pytest.approx(sorted(r["train_time_s"]["nominal"] / 3600 for r in mine))
    # each point's error bar spans its band: the time's low to high, the cost alike (it scales with time)
    (container,) = [c for c in ax.containers if c.lines[0].get_gid() == f"front {front[0]['backend']}"]
    segments = container.lines[2][0].get_segments()  # the x error bars
    spans = sorted(x for seg in segments for x in (seg[0][0], seg[1][0]))
    mine = [r for r in front if r["backend"] == front[0]["backend"]]
    bands = [r["train_time_s"][end] / 3600 for r in mine for end in ("low", "high")]
    assert spans == pytest.approx(sorted(bands))
    segments = container.lines[2][1].get_segments()  # the y error bars: the cost at the band's ends
    spans = sorted(y for seg in segments for y in (seg[0][1], seg[1][1]))
    costs = [
        r["cost_usd"] * r["train_time_s"][end] / r["train_time_s"]["nominal"]
        for r in mine
        for end in ("low", "high")
    ]
    assert spans == pytest.approx(sorted(costs))
    plt.close(fig)

    fig = parts_plot(rows)
    bars = {p.get_gid(): p.get_width() for p in fig.axes[0].patches if p.get_gid()}
    first = rows[0]
    for name, seconds in first["step_parts"].items():
        if seconds > 0:
            assert bars[f"{first['label']} {name}"] == pytest.approx(seconds * 1e3)
    plt.close(fig)

    # No price: the cost axis is GPU-hours
    fig = front_plot(ranked(price=None)[0])
    assert fig.axes[0].get_ylabel().startswith("GPU-hours")
    plt.close(fig)


def test_the_html_embeds_both_plots_and_escapes_text():
    import base64
    import io
    from html.parser import HTMLParser

    from PIL import Image

    from harness.document import render_html, render_md
    from harness.select.presentation import document

    rows, _ = ranked()
    sections = document(
        "SELECTED <b>&</b>", rows, [{"label": "x<y>", "gpus": 8, "why": "a & b"}], None, 5, True
    )
    page = render_html(sections)

    class Images(HTMLParser):
        def __init__(self):
            super().__init__()
            self.images = []

        def handle_starttag(self, tag, attrs):
            if tag == "img":
                self.images.append(dict(attrs))

    found = Images()
    found.feed(page)
    assert [i["alt"] for i in found.images] == ["Time to train against cost", "Predicted step parts"]
    for img in found.images:
        assert img["src"].startswith("data:image/png;base64,")
        png = Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1])))
        png.verify()
        assert png.size[0] > 300 and png.size[1] > 200
    assert "<b>&</b>" not in page and "SELECTED &lt;b&gt;&amp;&lt;/b&gt;." in page
    assert "x&lt;y&gt; N=8: a &amp; b" in page
    # the Markdown has the parts table, and no figure
    md = render_md(document("SELECTED", rows, [], None, 5, False))
    assert "| stack | N | predicted step (band) | compute |" in md and "base64" not in md
