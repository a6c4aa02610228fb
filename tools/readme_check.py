"""Run README.md's commands, in order, on a fresh clone in a fresh virtual environment.

    python tools/readme_check.py [--repo PATH] [--workdir DIR] [--venv VENV]

A doc test: the README is what a newcomer follows to the letter, so CI runs it the same
way (`.ci/run`, after the test suite). The repository's committed HEAD is cloned into an
empty folder and every line of every ```bash block runs there, in order, in one bash shell
with `set -e` (so the README's `. .venv/bin/activate` carries over to what follows); each
```python block runs with that shell's python at its place in the order. The environment
is the caller's minus any active virtual environment, so `python3 -m venv` starts from
the system's Python as it would on a fresh machine.

Four rules keep the run to minutes on a 2-core machine; each rewritten command is shown
in the log next to the README's text:

1. The README's test command (`python -m pytest -q`) is not run: CI runs it just before.
2. The first `fedmpi run` (the embedded default experiment) runs in full and its
   README claims are checked (round 0 near chance, final accuracy at least 0.9). Every
   later `fedmpi run` that starts a run, and `fedmpi sweep --run-cell`, runs its first 2
   rounds, with probes of 1-2 epochs: `--set rounds=2 --set eval.linear_epochs=2 --set
   eval.finetune_epochs=1` appended.
3. A `fedmpi run` whose `data.data_dir` names a folder this machine does not have (CIFAR
   on a cluster) is checked by resolving its config instead: `fedmpi config` with the same
   preset and overrides, which validates everything but the data.
4. `fedmpi evaluate` runs its probes for 1-2 epochs (the same two overrides).
5. With `--venv VENV` (CI's: `.ci/run` has just made VENV with the README's install lines,
   verbatim, on a fresh clone), the README's `python3 -m venv .venv` becomes a link to
   VENV: a second CUDA build of torch is ~6 GB of disk, more than some CI machines have
   left. Every install line after it still runs (pip finds torch and the extras there and
   points the editable install at the new clone; VENV's is pointed back at the end).

Exit code 0 when every command succeeded, 1 otherwise, with the failing command and the
tail of its output.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TEST_COMMAND = "python -m pytest -q"
SHORT = ["--set", "rounds=2", "--set", "eval.linear_epochs=2", "--set", "eval.finetune_epochs=1"]
PROBES_SHORT = SHORT[2:]
VENV_LINE = re.compile(r"^python3 -m venv \.venv(?= |$)")


@dataclass
class Step:
    """One README command: its text in the README and what runs (None = skipped)."""

    readme: str
    kind: str            # "bash" | "python"
    runs: str | None     # bash line, or the python source
    note: str = ""       # why it differs from the README, if it does


def blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", markdown, re.S | re.M)]


def bash_lines(body: str) -> list[str]:
    """Commands of a bash block: continuation lines joined, blank and comment lines dropped."""
    lines, pending = [], ""
    for raw in body.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _fedmpi_args(tokens: list[str], command: str) -> int | None:
    """Index of the first argument after `fedmpi <command>` in tokens, or None."""
    for i in range(len(tokens) - 1):
        if tokens[i] == "fedmpi" and tokens[i + 1] == command:
            return i + 2
    return None


def _missing_data_dir(args: list[str]) -> str | None:
    for token in args:
        if token.startswith("data.data_dir="):
            path = token.split("=", 1)[1]
            if not Path(path).expanduser().exists():
                return path
    return None


def plan(readme: str, venv: str | None = None) -> list[Step]:
    """The README's commands in order, with the rules of the module docstring applied."""
    steps: list[Step] = []
    runs_seen = 0
    for language, body in blocks(readme):
        if language == "python":
            steps.append(Step(body, "python", body))
            continue
        if language not in ("bash", "sh"):
            continue
        for line in bash_lines(body):
            step = _bash_step(line, runs_seen)
            if venv and VENV_LINE.match(line):   # rule 5
                step = Step(line, "bash", VENV_LINE.sub(f"ln -s {shlex.quote(venv)} .venv", line),
                            f"the venv {venv} that .ci/run made with this line")
            steps.append(step)
            runs_seen += _fedmpi_args(_tokens(line), "run") is not None
    return steps


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return []


def _bash_step(line: str, runs_seen: int) -> Step:
    if line.split("#")[0].strip() == TEST_COMMAND:
        return Step(line, "bash", None, "the test command: CI runs it before this check")
    tokens = _tokens(line)
    start = _fedmpi_args(tokens, "run")
    if start is not None:
        args = tokens[start:]
        missing = _missing_data_dir(args)
        if missing:
            kept, skip = [], False
            for token in args:   # `fedmpi config` takes the config, --preset and --set only
                if skip:
                    skip = False
                elif token in ("-o", "--output"):
                    skip = True
                elif token not in ("--force", "-q", "--quiet"):
                    kept.append(token)
            return Step(line, "bash", shlex.join(["fedmpi", "config", *kept]) + " >/dev/null",
                        f"data {missing} is not on this machine: its config is resolved instead")
        if runs_seen and "--resume" not in args:
            return Step(line, "bash", shlex.join(tokens + SHORT), "its first 2 rounds")
        return Step(line, "bash", line)
    sweep = _fedmpi_args(tokens, "sweep")
    if sweep is not None and "--run-cell" in tokens:
        return Step(line, "bash", shlex.join(tokens + SHORT), "its first 2 rounds")
    if _fedmpi_args(tokens, "evaluate") is not None:
        return Step(line, "bash", shlex.join(tokens + PROBES_SHORT), "probes of 1-2 epochs")
    return Step(line, "bash", line)


def script(steps: list[Step], scratch: Path) -> str:
    """One bash script running the steps in order, each announced and timed."""
    out = ["set -eo pipefail"]
    for i, step in enumerate(steps):
        shown = step.readme if step.kind == "bash" else f"<python block {i}>"
        out.append(f"printf '\\n[%d] $ %s\\n' {i} {shlex.quote(shown)}")
        if step.runs is None:
            out.append(f"echo {shlex.quote('    skipped: ' + step.note)}")
            continue
        if step.note:
            out.append(f"echo {shlex.quote('    runs: ' + step.runs + '   (' + step.note + ')')}")
        out.append("t0=$(date +%s%N)")
        if step.kind == "python":
            source = scratch / f"readme_block_{i}.py"
            source.write_text(step.runs)
            # from stdin, as pasted into python in the checkout: sys.path[0] is the checkout
            out.append(f"python - < {shlex.quote(str(source))}")
        else:
            out.append(step.runs)
        out.append(f"printf '    ok [%d] %d ms\\n' {i} $(( ($(date +%s%N) - t0) / 1000000 ))")
    return "\n".join(out) + "\n"


def clean_environment() -> dict[str, str]:
    """The caller's environment without an active virtual environment."""
    env = dict(os.environ)
    venv = env.pop("VIRTUAL_ENV", None)
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                      if not p.startswith(venv))
    env.pop("PYTHONPATH", None)
    return env


def check_default_run(clone: Path) -> str | None:
    """The README's claims about `fedmpi run`: its file, round 0 near chance, >= 0.9 at the end."""
    found = sorted((clone / "runs").glob("default-fedavg-seed0-*.h5"))
    if len(found) != 1:
        return (f"expected one runs/default-fedavg-seed0-<digest>.h5 after `fedmpi run`, "
                f"found {[p.name for p in found]}")
    path = found[0]
    code = ("import h5py, sys\n"
            f"f = h5py.File({str(path)!r}, 'r')\n"
            "r, a = f['rounds/round'][:], f['rounds/test_acc'][:]\n"
            "print(f.attrs['status'], int(r[0]), float(a[0]), float(a[-1]))\n")
    proc = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", code],
                          capture_output=True, text=True)
    if proc.returncode:
        return f"cannot read {path}: {proc.stderr.strip().splitlines()[-1:]}"
    status, first_round, first, last = proc.stdout.split()
    if status != "completed" or first_round != "0" or not float(first) < 0.3 \
            or not float(last) >= 0.9:
        return (f"{path.name}: status {status}, first row round {first_round} at accuracy "
                f"{float(first):.3f}, final {float(last):.3f}; the README promises a completed "
                f"run from near chance at round 0 to about 0.94")
    print(f"    default run: round 0 accuracy {float(first):.3f}, final {float(last):.3f}")
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--workdir", help="where to clone and keep the clone, its venv and the log "
                        "(default: a temporary folder, removed at the end: the venv is ~6 GB)")
    parser.add_argument("--venv", help="a venv the README's install lines made (CI's): linked "
                        "instead of `python3 -m venv .venv`, its editable install restored "
                        "at the end")
    args = parser.parse_args(argv)
    venv = str(Path(args.venv).resolve()) if args.venv else None
    if venv and not (Path(venv) / "bin" / "activate").is_file():
        print(f"readme_check: --venv {args.venv}: no bin/activate there", file=sys.stderr)
        return 2
    try:
        if args.workdir:
            return check(args.repo, Path(args.workdir), venv)
        with tempfile.TemporaryDirectory(prefix="fedmpi-readme-") as work:
            return check(args.repo, Path(work), venv)
    finally:
        if venv:   # the README's `pip install -e` pointed it at the clone: point it back
            back = subprocess.run([str(Path(venv) / "bin" / "pip"), "install", "-q", "--no-deps",
                                   "-e", args.repo], env=clean_environment())
            if back.returncode:
                print(f"readme_check: could not point {venv}'s fedmpi back at {args.repo}",
                      file=sys.stderr)


def check(repo: str, work: Path, venv: str | None = None) -> int:
    clone = work / "fedmpi"
    subprocess.run(["git", "clone", "--quiet", repo, str(clone)], check=True)
    steps = plan((clone / "README.md").read_text(), venv)
    (work / "readme.sh").write_text(script(steps, work))
    print(f"readme_check: {len(steps)} commands from README.md, in {clone}", flush=True)
    start = time.perf_counter()
    log = work / "readme.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(work / "readme.sh")], cwd=clone, env=clean_environment(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            if line.startswith(("[", "    ")):
                print(line, end="", flush=True)
        proc.wait()
    elapsed = time.perf_counter() - start
    if proc.returncode:
        tail = log.read_text().splitlines()[-40:]
        print("\n".join(["", f"readme_check: FAILED (exit {proc.returncode}) after {elapsed:.0f} s; "
                         f"the last lines of {log} (kept only with --workdir):", *tail]), file=sys.stderr)
        return 1
    problem = check_default_run(clone)
    if problem:
        print(f"readme_check: FAILED: {problem}", file=sys.stderr)
        return 1
    print(f"readme_check: every README command ran ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
