"""The record of installing Transformer Engine on a GPU node: each phase's time and the smoke check.

docker/te_offline/te_node_setup.sh appends one line per phase (`name<TAB>exit status<TAB>seconds`)
to a file in its store, which outlives each run of the script, and its `setup` run turns that
file and the smoke check's JSON (docker/te_offline/te_smoke.py) into `$OUT/te_setup.json`.
`read_report` refuses a file that is not such a record instead of reporting half of one.

    python3 docker/te_offline/te_setup_report.py write --phases /tmp/te/phases.tsv \\
        --smoke $OUT/te_smoke.json --build carried --out $OUT/te_setup.json
    python3 docker/te_offline/te_setup_report.py show out/gpu/te_setup.json
"""

import argparse
import json
import sys
from pathlib import Path

FORMAT = "megatron-async-te-setup/1"
BUILDS = ("carried", "node")  # the extension te_prepare.sh carried, or one built on the node


class ReportError(Exception):
    """A phases file or report that is not what te_node_setup.sh writes."""


def read_phases(path) -> list[dict]:
    phases = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        try:
            name, rc, seconds = fields
            phases.append({"name": name, "rc": int(rc), "seconds": round(float(seconds), 2)})
        except ValueError:
            raise ReportError(f"{path}:{number}: expected name<TAB>rc<TAB>seconds, got {line!r}") from None
    return phases


def build_report(phases: list[dict], smoke: dict | None, build: str) -> dict:
    if build not in BUILDS:
        raise ReportError(f"build must be one of {BUILDS}, got {build!r}")
    return {"format": FORMAT, "build": build, "phases": phases,
            "setup_s": round(sum(p["seconds"] for p in phases), 2), "smoke": smoke,
            "ok": bool(smoke and smoke.get("ok")) and bool(phases) and phases[-1]["rc"] == 0}


def read_report(path) -> dict:
    """The report, checked field by field."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ReportError(f"cannot read {path}: {e}") from None
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise ReportError(f"{path} is not a {FORMAT} report")
    if report.get("build") not in BUILDS:
        raise ReportError(f"{path}: build {report.get('build')!r} is not one of {BUILDS}")
    phases = report.get("phases")
    if not isinstance(phases, list) or not all(
            isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("rc"), int)
            and isinstance(p.get("seconds"), (int, float)) for p in phases):
        raise ReportError(f"{path}: phases must be a list of {{name, rc, seconds}}")
    if not isinstance(report.get("ok"), bool) or not (report.get("smoke") is None or isinstance(report["smoke"], dict)):
        raise ReportError(f"{path}: ok must be true or false and smoke an object or null")
    return report


def summary(report: dict) -> list[str]:
    """One setup in a few lines: phases, total, versions, the fp8 difference."""
    lines = [f"{p['name']}: {p['seconds']:.1f} s" + ("" if p["rc"] == 0 else f" (exit {p['rc']})")
             for p in report["phases"]]
    lines.append(f"total: {report['setup_s']:.1f} s; extension {report['build']}; "
                 f"{'ok' if report['ok'] else 'NOT ok'}")
    smoke = report.get("smoke") or {}
    if smoke:
        seen = [f"{label} {smoke[key]}" for label, key in (("TE", "te"), ("torch", "torch"), ("git", "torch_git"),
                                                              ("on", "device"), ("fp8", "fp8_available"))
                if smoke.get(key) is not None]
        lines.append(f"smoke: {smoke.get('stage')}; " + ", ".join(seen))
        diff = smoke.get("fp8_vs_bf16")
        if diff:
            lines.append("fp8 against bf16 (relative): " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items())
                         + f"; tolerance {smoke.get('tolerance')}")
        if smoke.get("error"):
            lines.append(f"error: {smoke['error']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="te_setup_report.py",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("write")
    p.add_argument("--phases", required=True)
    p.add_argument("--smoke", help="te_smoke.py's JSON; left out or absent: no smoke ran")
    p.add_argument("--build", required=True, choices=BUILDS)
    p.add_argument("--out", required=True)
    p = sub.add_parser("show")
    p.add_argument("report")
    args = parser.parse_args(argv)
    try:
        if args.command == "write":
            smoke = None
            if args.smoke and Path(args.smoke).is_file():
                smoke = json.loads(Path(args.smoke).read_text(encoding="utf-8"))
            report = build_report(read_phases(args.phases), smoke, args.build)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        else:
            report = read_report(args.report)
        print("\n".join(summary(report)))
    except ReportError as e:
        print(f"te_setup_report: error: {e}", file=sys.stderr)
        return 2
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
