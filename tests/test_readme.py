"""The README cannot drift: CI installs what it says, `fedmpi --help` matches it, and
tools/readme_check.py (run by CI after the suite) runs its commands as this file expects."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import readme_check  # noqa: E402

README = (ROOT / "README.md").read_text()


def _install_block() -> list[str]:
    section = README[README.index("## Install"):README.index("## The two commands")]
    (language, body), = readme_check.blocks(section)
    assert language == "bash"
    return [re.sub(r"\s+#.*$", "", line) for line in readme_check.bash_lines(body)]


def test_ci_installs_exactly_what_the_readme_says():
    ci = (ROOT / ".ci" / "run").read_text()
    lines = _install_block()
    assert any("apt-get install -y dataset-fashion-mnist" in line for line in lines)
    assert any("'.[mpi,test,analysis]'" in line for line in lines)
    for line in lines:
        assert line in ci, f".ci/run does not run the README's install line {line!r}"
    # and the README's test command, then the README check
    assert "\npython -m pytest -q\n" in ci and "python tools/readme_check.py" in ci
    assert "python -m pytest -q" in readme_check.bash_lines(
        readme_check.blocks(README[README.index("## The two commands"):])[1][1])[0]


def test_help_lists_every_command_whole_and_the_readme_shows_each():
    proc = subprocess.run([sys.executable, "-m", "fedmpi", "--help"], capture_output=True,
                          text=True, check=True)
    commands = re.findall(r"^  (\w+)  ", proc.stdout.split("Commands:")[1], re.M)
    assert {"run", "sweep", "datasets", "report", "watch"} <= set(commands)
    assert "..." not in proc.stdout.split("Commands:")[1]
    for command in commands:
        assert f"fedmpi {command}" in README, f"`fedmpi {command}` is not in the README"


def test_readme_check_runs_every_command_and_shortens_only_by_its_rules():
    steps = readme_check.plan(README)
    bash = [s for s in steps if s.kind == "bash"]
    test, = [s for s in bash if s.readme.startswith("python -m pytest")]
    assert test.runs is None                          # rule 1: CI ran the suite already
    runs = [s for s in bash if readme_check._fedmpi_args(readme_check._tokens(s.readme), "run")
            is not None]
    assert runs[0].readme == "fedmpi run" and runs[0].runs == "fedmpi run"   # rule 2: in full
    for step in runs[1:]:
        if "--resume" in step.readme:
            assert step.runs == step.readme
        elif "data.data_dir=/data/" in step.readme:   # rule 3: only its config is resolved
            assert step.runs.startswith("fedmpi config --preset ") and "mpirun" not in step.runs
        else:
            assert step.runs.endswith(" ".join(readme_check.SHORT))
    assert all(s.runs == s.readme for s in bash
               if not s.note), "a command differs from the README without a stated rule"
    assert any(s.kind == "python" and "analysis.load" in s.runs for s in steps)


@pytest.mark.parametrize("line,expected", [
    ("mpirun -n 2 fedmpi run x.toml -o out.h5 --force --set data.data_dir=/nope/x  # c",
     "fedmpi config x.toml --set data.data_dir=/nope/x >/dev/null"),
    ("fedmpi run --preset p --set 'name=a b'", "fedmpi run --preset p --set 'name=a b' "
     + " ".join(readme_check.SHORT)),
    ("fedmpi config > exp.toml   # start", "fedmpi config > exp.toml   # start"),
])
def test_readme_check_rewrites(line, expected):
    assert readme_check._bash_step(line, runs_seen=1).runs == expected


def test_readme_check_with_a_venv_links_it_and_still_runs_every_install_line():
    plain, linked = readme_check.plan(README), readme_check.plan(README, "/ci/clone/.venv")
    assert len(plain) == len(linked)
    changed = [(a, b) for a, b in zip(plain, linked) if a.runs != b.runs]
    (a, b), = changed                                   # only `python3 -m venv .venv`
    assert a.readme.startswith("python3 -m venv .venv") and a.runs == a.readme
    assert b.runs == "ln -s /ci/clone/.venv .venv && . .venv/bin/activate" and b.note
    assert any(s.runs and s.runs.startswith("pip install torch==") for s in linked)


def test_readme_check_refuses_a_venv_without_activate(tmp_path, capsys):
    assert readme_check.main(["--venv", str(tmp_path)]) == 2
    assert "--venv" in capsys.readouterr().err
