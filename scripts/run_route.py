"""The route a run config takes from `pretrain` to the model, counted on a real run.

Every call of a lit_transformer function that receives the run config (a RunConfig, or the
resolved run built from it) is a stop (not the config's own methods, nor dunder methods such as
a dataclass's generated __init__); the stops are recorded in order, from the command line's
`pretrain` or `finetune` to the objective that builds the model (the first stop in
objectives/). A "return up the layer ladder" is a stop in a higher layer than the stop before it
(layers as tests/test_architecture.py's LAYERS): the config went down into a lower layer and came
back up. A module's "visits" are the separate stretches of consecutive stops in
it: `auto` sizing should visit each of its modules once.

    python scripts/run_route.py            # four routes: from scratch, `auto`, resumed, fine-tuned
    python scripts/run_route.py --stops    # and every stop, in order

Each route is the command line's `pretrain` or `finetune` on a shipped recipe, 1 step, in a
temporary directory (a few seconds each; `auto` measures the speed for about 3 s).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_architecture import LAYERS  # noqa: E402

CONFIG_TYPES = {"RunConfig", "ResolvedRun"}


def layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next((i for i, names in enumerate(LAYERS) if top in names), 0)


def trace(argv: list[str]) -> list[tuple[str, str]]:
    """The stops of one command line, until training starts."""
    from lit_transformer.commands.cli import main

    stops: list[tuple[str, str]] = []
    recording = [True]

    def profile(frame, event, arg):
        if event != "call" or not recording[0]:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("lit_transformer"):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        own = names and names[0] == "self" and type(frame.f_locals.get("self")).__name__ in CONFIG_TYPES
        if code.co_name.startswith("__") or own:
            return  # a dataclass's generated methods, and the config's own methods: not a stop on its route
        if any(type(frame.f_locals.get(n)).__name__ in CONFIG_TYPES for n in names):
            stops.append((module, code.co_qualname))
            recording[0] = not module.startswith("lit_transformer.objectives")

    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    assert code == 0, f"{argv} exited with {code}"
    return stops


def routes(tmp: str) -> dict[str, list[str]]:
    short = [
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        "generation.enabled=false",
        "logger.wandb.mode=disabled",
    ]
    return {
        "pretrain tiny-clm": ["pretrain", "tiny-clm", f"run.dir={tmp}/clm", *short],
        "pretrain tiny-clm, resumed": [
            "pretrain",
            "tiny-clm",
            f"run.dir={tmp}/clm",
            "resume=auto",
            *short[1:],
            "trainer.max_steps=2",
        ],
        "pretrain speedrun-clm (auto)": [
            "pretrain",
            "speedrun-clm",
            f"run.dir={tmp}/auto",
            "trainer.max_time=30",
            "data.max_train_bytes=200000",
            *short,
        ],
        "finetune tiny-classify-from-pretrained from tiny-clm": [
            "finetune",
            "tiny-classify-from-pretrained",
            f"run.dir={tmp}/ft",
            f"finetune.from={tmp}/clm",
            *short,
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stops", action="store_true", help="print every stop")
    args = parser.parse_args()
    total_stops = total_climbs = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in routes(tmp).items():
            stops = trace(argv)
            climbs = sum(layer(b[0]) > layer(a[0]) for a, b in zip(stops, stops[1:]))
            visits: collections.Counter = collections.Counter()
            for i, (module, _) in enumerate(stops):
                if i == 0 or stops[i - 1][0] != module:
                    visits[module] += 1
            if args.stops:
                for module, function in stops:
                    print(f"  {layer(module)} {module.removeprefix('lit_transformer.')}:{function}")
            print(f"{name}: {len(stops)} stops, {climbs} returns up the layer ladder")
            print(
                "  visits: " + ", ".join(f"{m.removeprefix('lit_transformer.')} {n}" for m, n in visits.most_common())
            )
            total_stops, total_climbs = total_stops + len(stops), total_climbs + climbs
    print(f"all routes: {total_stops} stops, {total_climbs} returns up the layer ladder")


if __name__ == "__main__":
    main()
