"""`harness report` and `harness results` on hand-made records of all six stacks."""

import base64
import io
import itertools
import json
import re
import subprocess
import sys
from html.parser import HTMLParser

import pandas as pd
import pytest
from browser import CHROMIUM, headless
from PIL import Image
from record_factory import BACKENDS, make_record

from core.records import write_json_atomic
from harness.cli import main

pytestmark = pytest.mark.unit

MiB = 1 << 20
# label -> (step time N=1, step time N=2, compute-only time N=2, peak RSS N=1, N=2 in MiB)
TIMES = {
    "torch-ddp": (0.10, 0.125, 0.10, 400, 500),
    "torch-fsdp": (0.11, 0.15, 0.12, 380, 420),
    "deepspeed-zero3": (0.12, 0.16, 0.13, 390, 410),
    "horovod": (0.10, 0.13, 0.11, 400, 480),
    "tf-mwms": (0.13, 0.17, 0.14, 600, 650),
    "paddle-fleet": (0.12, 0.14, 0.125, 500, 560),
}


@pytest.fixture
def results_dir(tmp_path):
    for label, (t1, t2, c2, m1, m2) in TIMES.items():
        for repeat in range(2):
            for n, t, c, m in ((1, t1, None, m1), (2, t2, c2, m2)):
                rec = make_record(label, n, t, c, peak_rss=m * MiB, repeat=repeat)
                write_json_atomic(tmp_path / f"{rec['run_id']}.json", rec)
    failed = make_record("horovod", 2, status="failed", repeat=2)
    write_json_atomic(tmp_path / f"{failed['run_id']}.json", failed)
    return tmp_path


def report_md(capsys, *argv) -> str:
    assert main(["report", *map(str, argv)]) == 0
    return capsys.readouterr().out


def test_md_report_lists_every_backends_scaling_figures(results_dir, capsys):
    md = report_md(capsys, results_dir)
    rows = {
        line.split("|")[1].strip(): line
        for line in md.splitlines()
        if line.startswith("| ")
        and line.split("|")[2].strip() == "2"
        and "tok/s" not in line
        and " ok" in line.split("|")[3]  # the scaling table's, not the anatomy's
    }
    for label in BACKENDS:
        assert label in rows, label
    # torch-ddp at N=2: 16,384 tok/s, speedup 1.6, efficiency 80%, memory ratio 500/400, 20% exposed comm
    ddp = [c.strip() for c in rows["torch-ddp"].split("|")[1:-1]]
    assert ddp[3].startswith("16,384") and ddp[5] == "1.60x" and ddp[6] == "80%" and ddp[8] == "1.25"
    assert ddp[9] == "16.4 MiB (1.000x analytic)"  # 16 B x 1,071,872 params = 17,149,952 B measured, by hand
    assert ddp[10] == "20.0%"
    assert "2 ok, 1 failed" in rows["horovod"]
    assert "RuntimeError: injected fault at step 1" in md  # the failed run is listed with its error
    assert "OVERSUBSCRIBED" not in md  # 2 workers x 1 thread fit the factory's 2 CPUs


def test_selection_sentences_follow_the_numbers(results_dir, capsys):
    md = report_md(capsys, results_dir, "--at-gpus", "2")
    sentences = {line.split(":")[0]: line for line in md.splitlines() if line.split(":")[0] in BACKENDS}
    assert sentences["torch-ddp"].startswith("torch-ddp: fastest at N=2 (1.00x of best)")
    assert "50% of torch-ddp's per-rank model state" in sentences["torch-fsdp"]
    assert "pick it when memory is the constraint" in sentences["torch-fsdp"]
    assert "though torch-fsdp is as lean and" in sentences["deepspeed-zero3"]
    assert "no measured advantage at N=2" in sentences["tf-mwms"]
    ranking = re.findall(r"^\| (\d) \| ([\w-]+) \|", md, re.M)
    assert [label for _, label in ranking][:2] == ["torch-ddp", "horovod"]

    # Make FSDP the fastest too: its sentence must change with the numbers.
    for path in results_dir.glob("test-torch-fsdp-n2-*.json"):
        rec = make_record("torch-fsdp", 2, 0.1, 0.09, repeat=int(path.stem[-4]))
        write_json_atomic(path, rec)
    md = report_md(capsys, results_dir, "--at-gpus", "2")
    line = next(md_line for md_line in md.splitlines() if md_line.startswith("torch-fsdp:"))
    assert "fastest at N=2" in line and "pick it: fastest and leanest here" in line


def test_noisy_rows_are_marked(results_dir, capsys):
    noisy = make_record("tf-mwms", 2, 0.25, 0.14, peak_rss=650 * MiB, repeat=5)
    write_json_atomic(results_dir / f"{noisy['run_id']}.json", noisy)
    md = report_md(capsys, results_dir)
    row = next(md_line for md_line in md.splitlines() if md_line.startswith("| tf-mwms | 2 |"))
    assert "NOISY" in row and "(noisy)" in row
    assert "re-measure before deciding" in md


class Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.open, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs))
        elif tag not in ("meta", "br"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open.pop() == tag, f"unbalanced </{tag}>"

    def handle_data(self, data):
        self.text.append(data)


def test_html_report_is_self_contained_with_every_plot(results_dir, tmp_path, capsys):
    out = tmp_path / "out" / "report.html"
    assert main(["report", str(results_dir), "--format", "html", "--output", str(out)]) == 0
    parser = Collector()
    parser.feed(out.read_text())
    assert parser.open == []
    titles = [img["alt"] for img in parser.images]
    assert titles == [
        "Speedup vs N",
        "Scaling efficiency",
        "Per-rank peak memory",
        "Exposed-communication ratio",
        "Throughput by backend",
        "Step anatomy by stack and N",
    ]
    for img in parser.images:
        assert img["src"].startswith("data:image/png;base64,")  # embedded: opens offline
        png = Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1])))
        png.verify()
        assert png.size[0] > 300 and png.size[1] > 200
    text = " ".join(parser.text)
    for label in BACKENDS:
        assert label in text
    assert "Environment" in text and "cpu: Test CPU" in text and "Features of each adapter" in text
    assert "torchrun" in text  # feature table, from the registered adapter class
    assert not {"torch", "tensorflow", "paddle"} & set(sys.modules)  # the harness imported no framework


def test_results_export_csv_parquet_and_aggregate(results_dir, tmp_path, capsys):
    csv, parquet = tmp_path / "runs.csv", tmp_path / "runs.parquet"
    assert main(["results", str(results_dir), "--csv", str(csv), "--parquet", str(parquet)]) == 0
    runs = pd.read_csv(csv)
    assert len(runs) == 25 and runs["run_id"].is_unique
    assert len(pd.read_parquet(parquet)) == 25
    assert set(runs.loc[runs["status"] == "ok", "label"]) == set(BACKENDS)
    agg_csv = tmp_path / "agg.csv"
    assert main(["results", str(results_dir), "--aggregate", "--csv", str(agg_csv)]) == 0
    agg = pd.read_csv(agg_csv)
    assert len(agg) == 12
    ddp = agg[(agg["label"] == "torch-ddp") & (agg["world_size"] == 2)].iloc[0]
    assert ddp["speedup"] == pytest.approx(1.6) and ddp["memory_ratio"] == pytest.approx(1.25)


def test_corrupt_file_is_skipped_by_name(results_dir, capsys):
    (results_dir / "broken.json").write_text("{not json")
    (results_dir / "foreign.json").write_text(json.dumps({"hello": 1}))
    assert main(["report", str(results_dir)]) == 0
    out, err = capsys.readouterr()
    assert "25 run record(s)" in out
    assert "broken.json" in err and "foreign.json" in err


def test_no_records_is_a_usage_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error: no run records")
    assert main(["report", str(tmp_path), "--noise-cv", "5"]) == 2
    assert main(["report", str(tmp_path), "--format", "pdf"]) == 2


# A sweep of N = 1..32 on the factory's 2-core machine (1 thread per worker): N >= 4 oversubscribes it.
SWEEP_NS = (1, 2, 4, 8, 16, 32)
CROWDED = {4, 8, 16, 32}
SWEEP_LABELS = ("torch-ddp", "torch-fsdp")


def sweep_records(ns=SWEEP_NS) -> list[dict]:
    return [
        make_record(label, n, 0.1 * (1 + 0.1 * i) * max(1.0, n / 2), compute_time=0.09 * max(1.0, n / 2))
        for i, label in enumerate(SWEEP_LABELS)
        for n in ns
    ]


@pytest.fixture
def sweep_dir(tmp_path):
    for rec in sweep_records():
        write_json_atomic(tmp_path / f"{rec['run_id']}.json", rec)
    return tmp_path


def scaling_n_cells(rows) -> dict[tuple[str, int], str]:
    """(label, N) -> the N cell of every scaling-table row (rows: lists of cells)."""
    return {
        (row[0], int(row[1].split()[0])): row[1]
        for row in rows
        if len(row) > 3 and row[0] in SWEEP_LABELS and row[1].split()[0].isdigit() and "ok" in row[2]
    }


def assert_marked_exactly_the_crowded(cells):
    assert set(cells) == {(label, n) for label in SWEEP_LABELS for n in SWEEP_NS}
    for (label, n), cell in cells.items():
        assert cell == (f"{n} OVERSUBSCRIBED" if n in CROWDED else str(n)), (label, n, cell)


def test_markdown_marks_every_oversubscribed_row_and_sentence(sweep_dir, capsys):
    md = report_md(capsys, sweep_dir)
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in md.splitlines() if line.startswith("| ")]
    assert_marked_exactly_the_crowded(scaling_n_cells(rows))
    legend = next(line for line in md.splitlines() if line.startswith("OVERSUBSCRIBED (rows marked so"))
    assert "at N = 4, 8, 16, 32" in legend and "than the 2 CPU(s) they may use" in legend
    # The ranking defaults to the largest N that fits the CPUs, and says why.
    assert "### Framework selection at N=2: tiny" in md
    assert "Ranked at N=2, the largest N whose runs fit the CPUs: at N = 4, 8, 16, 32" in md
    sentences = [line for line in md.splitlines() if line.split(":")[0] in SWEEP_LABELS]
    assert len(sentences) == 2 and not any("OVERSUBSCRIBED" in line for line in sentences)

    # Ranked where every run is oversubscribed: the title, each ranked row and each sentence say so.
    md = report_md(capsys, sweep_dir, "--at-gpus", "32")
    assert "### Framework selection at N=32 (OVERSUBSCRIBED): tiny" in md
    ranking = re.findall(r"^\| (\d) \| ([^|]+) \|", md, re.M)
    assert [cell.strip() for _, cell in ranking] == [f"{label} OVERSUBSCRIBED" for label in SWEEP_LABELS]
    sentences = [line for line in md.splitlines() if line.split(":")[0] in SWEEP_LABELS]
    assert len(sentences) == 2
    assert all("(OVERSUBSCRIBED at N=32: these figures measure contention" in line for line in sentences)


class Cells(HTMLParser):
    """The rows of every <table>, as lists of cell texts; and the paragraphs."""

    def __init__(self):
        super().__init__()
        self.rows, self.paragraphs, self.where = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")
            self.where = "cell"
        elif tag == "p":
            self.paragraphs.append("")
            self.where = "p"

    def handle_endtag(self, tag):
        if tag in ("td", "th", "p"):
            self.where = None

    def handle_data(self, data):
        if self.where == "cell":
            self.rows[-1][-1] += data
        elif self.where == "p":
            self.paragraphs[-1] += data


def test_html_marks_every_oversubscribed_row(sweep_dir, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(sweep_dir), "--html", str(out)]) == 0
    page = Cells()
    page.feed(out.read_text())
    assert_marked_exactly_the_crowded(scaling_n_cells(page.rows))
    assert any(p.startswith("OVERSUBSCRIBED (rows marked so; hollow / hatched") for p in page.paragraphs)


def test_plots_mark_every_oversubscribed_point_on_a_log2_axis():
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    from harness.analyze.analysis import aggregate, runs_table
    from harness.analyze.report.contexts import HOLLOW
    from harness.analyze.report.training import plots

    figs = dict(plots(aggregate(runs_table(sweep_records()))))
    assert len(figs) == 5
    for title, fig in figs.items():
        ax = fig.axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert HOLLOW in legend and set(SWEEP_LABELS) <= set(legend), title
        gids = {}
        for artist in [*ax.get_lines(), *ax.patches]:
            gids.setdefault(artist.get_gid(), []).append(artist)
        if title == "Throughput by backend":  # categorical N: bars hatched where oversubscribed
            assert [t.get_text() for t in ax.get_xticklabels()] == list(map(str, SWEEP_NS))
            bars = {c.get_label(): c.patches for c in ax.containers if isinstance(c, BarContainer)}
            for label in SWEEP_LABELS:
                assert [bool(b.get_hatch()) for b in bars[label]] == [n in CROWDED for n in SWEEP_NS], label
                assert len(gids[f"oversubscribed {label}"]) == len(CROWDED)
            continue
        assert ax.get_xscale() == "log"
        assert list(ax.get_xticks()) == list(SWEEP_NS)
        assert [t.get_text() for t in ax.get_xticklabels()] == list(map(str, SWEEP_NS))
        for label in SWEEP_LABELS:
            (hollow,) = gids[f"oversubscribed {label}"]
            (filled,) = gids[f"fits {label}"]
            assert set(hollow.get_xdata()) == CROWDED and hollow.get_markerfacecolor() in ("white", "w")
            assert set(filled.get_xdata()) == set(SWEEP_NS) - CROWDED
            assert filled.get_markerfacecolor() == filled.get_color()
    for fig in figs.values():
        plt.close(fig)

    # Nothing oversubscribed (N = 1, 2 on 2 CPUs): no mark, and no legend entry for one.
    for _, fig in plots(aggregate(runs_table(sweep_records((1, 2))))):
        ax = fig.axes[0]
        assert HOLLOW not in [t.get_text() for t in ax.get_legend().get_texts()]
        assert not any(str(a.get_gid()).startswith("oversubscribed") for a in [*ax.get_lines(), *ax.patches])
        assert not any(p.get_hatch() for p in ax.patches)
        plt.close(fig)


# ----------------------------------------------------------------------------------------- step anatomy
# label -> (step, t_compute, [(forward, backward, optimizer) of each repeat]) at N=2, in seconds, by hand.
# torch-ddp: exposed 25 ms (20%), other = 100 − 30|32 − 50 − 10 = 10|8 ms, median forward 31, other 9.
# tf-mwms: slower, exposed 15 ms (10%), the least of the resolved ones. horovod: its workers without
# communication are slower than its synced step (250 > 200 ms): exposed unresolved, −50 ms. torch-fsdp:
# its isolated workers step all parameters (60 ms; a rank 1/2: t_compute 150 − 30 = 120 ms), 80 ms exposed.
ANATOMY = {
    "torch-ddp": (0.125, 0.10, [(0.030, 0.050, 0.010), (0.032, 0.050, 0.010)]),
    "tf-mwms": (0.150, 0.135, [(0.040, 0.070, 0.015)] * 2),
    "horovod": (0.200, 0.250, [(0.030, 0.050, 0.010)] * 2),
    "torch-fsdp": (0.200, 0.150, [(0.030, 0.050, 0.060)] * 2),
}


def with_parts(record: dict, forward: float, backward: float, optimizer: float) -> dict:
    """A record whose launch without communication (the sync-off ranks or the isolated workers) timed
    these parts in each of its three anatomy steps."""
    for rank in [*record["ranks"], *(record.get("isolated_ranks") or [])]:
        rank.update(forward_times=[forward] * 3, backward_times=[backward] * 3)
        rank["optimizer_step_times"] = [optimizer] * 3
    return record


def anatomy_records(labels=tuple(ANATOMY)) -> list[dict]:
    out = []
    for label in labels:
        step, compute, repeats = ANATOMY[label]
        for repeat, parts in enumerate(repeats):
            out.append(with_parts(make_record(label, 2, step, compute, repeat=repeat), *parts))
            out.append(make_record(label, 1, 0.1, repeat=repeat))
    return out


def write_records(folder, records):
    for rec in records:
        write_json_atomic(folder / f"{rec['run_id']}.json", rec)
    return folder


def anatomy_rows(md: str) -> dict[tuple[str, str], list[str]]:
    """(stack, N) -> the cells of the anatomy table's row."""
    lines = md.splitlines()
    start = lines.index("| stack | N | step | forward | backward | optimizer | exposed comm | other |")
    table = itertools.takewhile(lambda line: line.startswith("| "), lines[start + 2 :])
    return {(c[0], c[1]): c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in table)}


def sentences(md: str) -> dict[str, str]:
    return {line.split(":")[0]: line for line in md.splitlines() if line.split(":")[0] in BACKENDS}


def test_the_anatomy_table_shows_each_stacks_parts_at_each_n(tmp_path, capsys):
    from harness.analyze.metrics import summarize

    records = anatomy_records()
    md = report_md(capsys, write_records(tmp_path, records))
    rows = anatomy_rows(md)
    assert set(rows) == {(label, n) for label in ANATOMY for n in ("1", "2")}
    # by hand: the median over the two repeats of each part, and its share of the 125 ms step
    ddp = ["125.0 ms", "31.0 ms (25%)", "50.0 ms (40%)", "10.0 ms (8%)", "25.0 ms (20%)", "9.0 ms (7%)"]
    assert rows[("torch-ddp", "2")][2:] == ddp
    assert rows[("torch-fsdp", "2")][5] == "30.0 ms (15%)"  # 1/2 of the isolated worker's 60 ms optimizer
    # and, for every stack and N, the median of the records' own parts
    for (label, n), cells in rows.items():
        mine = [r for r in records if r["run_id"].startswith(f"test-{label}-n{n}-")]
        for i, part in enumerate(("forward", "backward", "optimizer", "exposed_comm", "other")):
            found = [summarize(r)["anatomy"]["parts"][part] for r in mine]
            if found[0]["status"] == "n/a":
                assert cells[3 + i] == f"n/a ({found[0]['method']})", (label, n, part)
                continue
            ms = sorted(f["s"] for f in found)
            median_ms = (ms[0] + ms[1]) / 2 * 1e3
            assert cells[3 + i].replace("unresolved ", "").replace("−", "-").startswith(f"{median_ms:.1f} ms")
    # a 1-rank run has no exposed communication by definition, and its parts were not timed here
    assert rows[("torch-ddp", "1")][6] == "0.0 ms (0%)"
    assert rows[("torch-ddp", "1")][3].startswith("n/a (not timed")


def test_an_unresolved_part_is_shown_so_and_never_advised_from(tmp_path, capsys):
    folder = write_records(tmp_path, anatomy_records())
    md = report_md(capsys, folder, "--at-gpus", "2")
    assert anatomy_rows(md)[("horovod", "2")][6] == "unresolved −50.0 ms"
    ranking = {cells[1]: cells for cells in (re.findall(r"^\| (\d) \| ([\w-]+) \|(.*)$", md, re.M))}
    assert ranking["horovod"][2].split("|")[-2].strip() == "unresolved"  # the ranking's exposed comm
    said = sentences(md)
    assert "exposed communication" not in said["horovod"] and " Its " not in said["horovod"]
    # tf-mwms has the least exposed communication of the stacks whose exposed part is known, but horovod's
    # is not known: no stack is the least beside it
    assert "10% of the step is exposed communication" in said["tf-mwms"]
    assert not any("least exposed communication" in line for line in said.values())

    # Without horovod, the same tf-mwms numbers are the least here: the advice follows the numbers.
    (other := tmp_path / "without").mkdir()
    md = report_md(capsys, write_records(other, anatomy_records(("torch-ddp", "tf-mwms", "torch-fsdp"))))
    assert "least exposed communication here" in sentences(md)["tf-mwms"]

    # One repeat unresolved, the other not: the group's exposed part is unresolved, its ratio no figure.
    (mixed := tmp_path / "mixed").mkdir()
    records = anatomy_records(("torch-ddp", "tf-mwms"))
    records.append(with_parts(make_record("horovod", 2, 0.2, 0.15, repeat=0), 0.03, 0.05, 0.01))
    records.append(with_parts(make_record("horovod", 2, 0.2, 0.25, repeat=1), 0.03, 0.05, 0.01))
    md = report_md(capsys, write_records(mixed, records), "--at-gpus", "2")
    assert anatomy_rows(md)[("horovod", "2")][6].startswith("unresolved ")
    assert "exposed communication" not in sentences(md)["horovod"]
    assert not any("least exposed communication" in line for line in sentences(md).values())


def test_a_stack_s_rank_is_explained_by_its_resolved_parts_only(tmp_path, capsys):
    md = report_md(capsys, write_records(tmp_path, anatomy_records()), "--at-gpus", "2")
    said = sentences(md)
    assert said["torch-fsdp"].endswith(
        " Its exposed communication is 40% of its step (80.0 ms against 25.0 ms for torch-ddp): "
        "55.0 ms of the 75.0 ms by which its step is longer."
    )
    assert " Its " not in said["torch-ddp"]  # the fastest: nothing to explain
    # horovod's other (250 − 90 = 160 ms) is 150 ms over torch-ddp's, but its exposed part is unresolved
    assert " Its " not in said["horovod"]


def test_the_anatomy_plot_draws_only_resolved_parts():
    import matplotlib.pyplot as plt

    from harness.analyze.analysis import aggregate, runs_table
    from harness.analyze.report.selection import anatomy_plot

    fig = anatomy_plot(aggregate(runs_table(anatomy_records())))
    ax = fig.axes[0]
    bars = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    texts = {t.get_gid(): t.get_text() for t in ax.texts}
    assert [bars[f"torch-ddp N=2 {k}"].get_width() for k in ("forward", "other")] == pytest.approx([31, 9])
    assert bars["torch-ddp N=2 exposed_comm"].get_x() == pytest.approx(31 + 50 + 10)
    assert "horovod N=2 exposed_comm" not in bars  # unresolved: not drawn...
    assert "exposed comm unresolved −50.0 ms" in texts["horovod N=2 undrawn"]  # ...but named
    assert "n/a: forward, backward, optimizer, other" in texts["torch-ddp N=1 undrawn"]
    assert "torch-ddp N=2 undrawn" not in texts
    plt.close(fig)


def test_html_embeds_the_anatomy_plot_and_escapes_text(tmp_path):
    records = anatomy_records(("torch-ddp", "horovod"))
    failed = make_record("horovod", 2, status="failed", repeat=5)
    failed["error"]["message"] = "<script>alert('x')</script> & more"
    out = tmp_path / "report.html"
    assert main(["report", str(write_records(tmp_path, [*records, failed])), "--html", str(out)]) == 0
    text = out.read_text()
    parser = Collector()
    parser.feed(text)
    (img,) = [i for i in parser.images if i["alt"] == "Step anatomy by stack and N"]
    png = Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1])))
    png.verify()
    assert "<script>" not in text and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in text
    page = Cells()
    page.feed(text)
    assert ["horovod", "2", "200.0 ms"] in [row[:3] for row in page.rows]  # the anatomy table's row
    assert any(cell == "unresolved −50.0 ms" for row in page.rows for cell in row)


@pytest.mark.subprocess
@pytest.mark.skipif(CHROMIUM is None, reason="no headless chromium here: the structure checks above stand")
def test_a_browser_renders_the_anatomy_plot(tmp_path):
    """The page as a browser draws it: the embedded anatomy plot is on the screen (its optimizer green and
    exposed-communication red, colours no other plot of this one-stack page draws)."""
    out, shot = tmp_path / "report.html", tmp_path / "shot.png"
    assert (
        main(["report", str(write_records(tmp_path, anatomy_records(("torch-ddp",)))), "--html", str(out)])
        == 0
    )
    subprocess.run(
        [*headless(tmp_path / "profile"), f"--screenshot={shot}", "--window-size=1280,6000", out.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    counts = {color: n for n, color in Image.open(shot).convert("RGB").getcolors(1 << 24)}
    assert counts.get((44, 160, 44), 0) > 100  # C2: the optimizer's
    assert counts.get((214, 39, 40), 0) > 100  # C3: exposed communication's


def test_a_stack_measured_at_several_settings_is_ranked_at_its_best_and_says_which(
    tmp_path, capsys, monkeypatch
):
    """Best against best: DeepSpeed measured at ZeRO-1 and ZeRO-3 is ranked once, at its faster stage, the
    slower named beside it with its throughput against it; at one rank, ZeRO-3's sharding is said to have
    nothing to shard."""
    import record_factory

    monkeypatch.setitem(record_factory.BACKENDS, "deepspeed-zero1", ("deepspeed", {"zero_stage": 1}))
    records = [
        make_record(label, n, t, repeat=repeat)
        for repeat in range(2)
        for n in (1, 2)
        for label, t in (("torch-ddp", 0.10), ("deepspeed-zero1", 0.12), ("deepspeed-zero3", 0.24))
    ]
    md = report_md(capsys, write_records(tmp_path, records), "--at-gpus", "2")
    ranking = md.split("Framework selection at N=2")[1].split("####")[0]
    table = [
        line.split("|")[2].strip() for line in ranking.splitlines() if line[:4] in ("| 1 ", "| 2 ", "| 3 ")
    ]
    assert table == ["torch-ddp", "deepspeed-zero1"]
    assert "deepspeed as deepspeed-zero1 (also measured: deepspeed-zero3 0.50x)" in ranking
    one = (
        report_md(capsys, tmp_path, "--at-gpus", "1").split("Framework selection at N=1")[1].split("####")[0]
    )
    zero1 = next(line for line in one.splitlines() if line.startswith("deepspeed-zero1:"))
    assert "at one rank there is nothing to shard: its optimizer sharding runs and saves nothing" in zero1
    assert "nothing to shard" not in next(line for line in one.splitlines() if line.startswith("torch-ddp:"))
