"""Each method's best trial of a finished tuning study, rerun at fresh seeds: the tuned
table without the selection's own upward bias (the best of N trials on one seed is
optimistic). Every rerun is the trial's config from its results file with another seed,
into {outdir}/{study name}_rerun/{method}-seed{k}.h5; files already there are kept.

    python benchmarks/studies/tune_rerun.py benchmarks/studies/tune_fmnist.toml --seeds 1 2 3
    fedmpi report runs/studies/tune_fmnist_rerun -g algorithm.name --columns final
"""

from __future__ import annotations

import argparse
import copy

from fedmpi import api, tune
from fedmpi import tune_worker as worker
from fedmpi.results import open_run


def best_trials(study):
    optuna = worker.optuna_module()
    store = worker.storage(study)
    out = {}
    for method in study.methods:
        target = worker.optuna_study(study, method, store)
        done = [t for t in target.get_trials(deepcopy=False)
                if t.state == optuna.trial.TrialState.COMPLETE]
        sign = -1.0 if study.directions[0] == "maximize" else 1.0
        out[method.name] = min(done, key=lambda t: (sign * t.values[0], t.number))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--outdir", help="the study's outdir, if the file's was overridden")
    args = parser.parse_args()
    study = tune.load(args.study, outdir=args.outdir)
    folder = study.directory.with_name(study.name + "_rerun")
    for name, trial in best_trials(study).items():
        with open_run(trial.user_attrs["output"]) as run:
            values = run.config
        for seed in args.seeds:
            output = folder / f"{name}-seed{seed}.h5"
            if output.exists():
                continue
            config = copy.deepcopy(values)
            config["seed"], config["output"] = seed, str(output)
            api.run(config)
            print(f"{name} (trial {trial.number}), seed {seed} -> {output}")


if __name__ == "__main__":
    main()
