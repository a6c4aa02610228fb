"""report.summarize on a synthetic run whose numbers are checkable by hand."""

from conftest import fedmpi
from fedmpi.analysis.report import summarize
from fedmpi.results import ResultsWriter
from fedmpi.results.schema import CLIENT_FIELDS, ROUND_FIELDS

NAN = float("nan")
CONFIG = {"algorithm": {"name": "fedavg"}, "data": {"dataset": "cifar10"}, "model": {"name": "cnn"},
          "partition": {"kind": "dirichlet", "alpha": 0.3}, "clients": {"num": 100, "per_round": 10},
          "rounds": 4}


def write_run(path, config=CONFIG, status="completed", initial=None, provenance=None,
              **status_attrs):
    """4 rounds; accuracy evaluated on rounds 2-4 only; 1 MB down + 0.5 MB up per round.
    With ``initial``: first the row of round 0, the initial model, evaluated to it (10 s,
    1 MB of MPI traffic, no FL traffic)."""
    acc = [NAN, 0.60, 0.75, 0.70]
    with ResultsWriter.create(path, config=config, provenance=provenance or {},
                              round_fields=list(ROUND_FIELDS), client_fields=list(CLIENT_FIELDS),
                              layout=[], partition={}) as writer:
        if initial is not None:
            writer.append_round({"round": 0, "test_acc": initial, "fl_bytes_down": 0, "fl_bytes_up": 0,
                                 "mpi_bytes": 1_000_000, "time_wall": 10.0, "time_eval": 10.0,
                                 "time_compute": 0.0, "time_comm": 0.0})
        for r in range(4):
            writer.append_round({"round": r + 1, "test_acc": acc[r], "fl_bytes_down": 1_000_000,
                                 "fl_bytes_up": 500_000, "mpi_bytes": 2_000_000, "time_wall": 2.0 + r,
                                 "time_compute": 2.0, "time_comm": 0.5})
        writer.set_status(status, **status_attrs)


def test_summary_has_the_expected_numbers(tmp_path):
    path = tmp_path / "run.h5"
    write_run(path)
    text = summarize(path)
    assert str(path) in text and "completed" in text
    for fact in ("fedavg", "cifar10", "cnn", "dirichlet (alpha=0.3)", "100 total, 10 per round",
                 "4 of 4 completed", "final 70.00% (round 4)", "best 75.00% (round 3)",
                 "6.00 MB (6000000 bytes)", "4.00 MB down, 2.00 MB up", "8.00 MB (8000000 bytes)",
                 "3.500 s mean wall", "compute 2.000 s (57%)", "comm 0.500 s (14%)"):
        assert fact in text, fact
    assert "aggregate" not in text  # never measured -> not printed
    assert 8 <= len(text.splitlines()) <= 15


def test_summary_with_round_zero_counts_trained_rounds_only(tmp_path):
    path = tmp_path / "run.h5"
    write_run(path, initial=0.1)
    text = summarize(path)
    for fact in ("4 of 4 completed", "final 70.00% (round 4), best 75.00% (round 3), initial 10.00% (round 0)",
                 "6.00 MB (6000000 bytes)", "MPI traffic  9.00 MB",   # round 0's MPI bytes count
                 "3.500 s mean wall", "compute 2.000 s (57%)"):      # per trained round
        assert fact in text, fact
    assert "eval" not in text   # measured in round 0 only, which is not a trained round


def test_summary_lines_are_aligned(tmp_path):
    path = tmp_path / "run.h5"
    write_run(path)
    starts = {len(line) - len(line[13:].lstrip()) for line in summarize(path).splitlines()}
    assert starts == {13}


def test_summary_tolerates_sparse_config_and_failure(tmp_path):
    path = tmp_path / "run.h5"
    write_run(path, config={"algorithm": "fedavg"}, status="failed", failed_round=4, error="loss is NaN")
    text = summarize(path)
    assert "failed at round 4: loss is NaN" in text
    assert "4 completed" in text and "dataset" not in text


def test_summary_names_the_ranks_and_the_kernels_they_ran(tmp_path):
    """The kernels decide the last bits: a run on two kinds of CPU, and a resume onto
    another, show in the report; a file from before the rank table kept them shows the
    ranks alone."""
    def ranks(*kinds):
        return [{"rank": r, "host": "node1" if r < 2 else "node2", "device": "cpu", "threads": 1,
                 **({"kernels": kind} if kind else {})} for r, kind in enumerate(kinds)]

    def ranks_line(provenance):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.h5"
        with ResultsWriter.create(path, config=CONFIG, provenance=provenance, round_fields=list(ROUND_FIELDS),
                                  client_fields=list(CLIENT_FIELDS), layout=[], partition={}) as writer:
            writer.set_status("completed")
        return [line for line in summarize(path).splitlines() if line.startswith("ranks")]

    assert ranks_line({"ranks": ranks("cpu AVX512")}) == ["ranks        1 on node1 (server and worker); cpu AVX512"]
    assert ranks_line({"ranks": ranks("cpu AVX512", "cpu AVX512", "cpu AVX2")}) == [
        "ranks        3 on node1, node2 (1 server, 2 workers); cpu AVX512 (ranks 0, 1), cpu AVX2 (rank 2)"]
    assert ranks_line({"ranks": ranks("cpu AVX2", "cpu AVX2"),
                       "resumes": [{"round": 4, "ranks": ranks("cpu AVX2", "cpu AVX2")},
                                   {"round": 6, "ranks": ranks("cpu AVX512")}]}) == [
        "ranks        2 on node1 (1 server, 1 worker); cpu AVX2; from round 6 on cpu AVX512"]
    # the same instruction set on another CPU model is another kind; a rank table from
    # before the model was recorded is compared by its instruction set only
    epyc, xeon = "cpu AVX512 on AMD EPYC 9654", "cpu AVX512 on Intel(R) Xeon(R) 8480+"
    assert ranks_line({"ranks": ranks(epyc), "resumes": [{"round": 3, "ranks": ranks(xeon)}]}) == [
        f"ranks        1 on node1 (server and worker); {epyc}; from round 3 on {xeon}"]
    resumes = [{"round": 3, "ranks": ranks(epyc)}, {"round": 5, "ranks": ranks(xeon)}]
    assert ranks_line({"ranks": ranks("cpu AVX512"), "resumes": resumes}) == [
        f"ranks        1 on node1 (server and worker); cpu AVX512; from round 5 on {xeon}"]
    assert ranks_line({"ranks": ranks(None, None)}) == ["ranks        2 on node1 (1 server, 1 worker)"]
    assert ranks_line({}) == []


def test_a_table_over_runs_on_other_kernels_names_them(tmp_path):
    """The same deterministic config ended 18-23 kNN points apart on two AVX-512 CPUs (a
    chaotic self-supervised run): a table that mixes them says under it which runs ran on
    which kernels, a resume onto others included; runs on one kind, and runs that recorded
    none, add nothing."""
    epyc, xeon = "cpu AVX512 on AMD EPYC 9654", "cpu AVX512 on Intel(R) Xeon(R) 8480+"

    def run(name, seed, *kinds, resumed=None):
        ranks = [{"rank": r, "host": "n1", "device": "cpu", "kernels": k}
                 for r, k in enumerate(kinds)]
        provenance = {"ranks": ranks} if kinds else {}
        if resumed:
            provenance["resumes"] = [{"round": 2, "ranks": [{**ranks[0], "kernels": resumed}]}]
        write_run(tmp_path / name, config={**CONFIG, "seed": seed}, provenance=provenance)
        return str(tmp_path / name)

    a, b, c = run("a.h5", 0, epyc, epyc), run("b.h5", 1, epyc), run("c.h5", 2, xeon, xeon)
    out = fedmpi(["report", a, b, c], check=True).stdout.splitlines()   # under the table
    assert f"kernels differ: {epyc} (2 of 3 runs), {xeon} (1 of 3 runs)" in out
    d = run("d.h5", 3, epyc, resumed=xeon)
    assert f"kernels differ: {epyc} (1 of 2 runs), {epyc} + {xeon} (1 of 2 runs)" in fedmpi(
        ["report", a, d], check=True).stdout.splitlines()
    # a run from before the CPU's model was recorded: compared by instruction set only
    old, avx2 = run("f.h5", 5, "cpu AVX512"), run("g.h5", 6, "cpu AVX2 on AMD EPYC 7763")
    assert (f"kernels differ: cpu AVX2 on AMD EPYC 7763 (1 of 3 runs), cpu AVX512 (1 of 3 "
            f"runs), {xeon} (1 of 3 runs)") in fedmpi(["report", old, c, avx2]).stdout.splitlines()
    assert "kernels differ: cpu AVX512 (1 of 3 runs), " in fedmpi(["report", old, a, c]).stdout
    for same in ([a, b], [a, run("e.h5", 4)], [old, a], [old, c]):
        assert "kernels differ" not in fedmpi(["report", *same], check=True).stdout
