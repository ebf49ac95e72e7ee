"""The Hugging Face export's peak memory and time against the model's size, under a memory limit.

    python -m bench.export.export_memory                         # 3 sizes, 2.5 GiB limit, about 4 minutes on 2 cores
    python -m bench.export.export_memory --sizes 32x4 --limit-gib 2 --json out.json
    python -m bench.export.export_memory --limit-kind as --limit-gib 6

Each size (EXPERTSxLAYERS: the 10B MoE example's layer, examples/moe_10b, at hidden 1024,
experts of FFN 1024, a 32,000-token vocabulary, bf16, untied) is written as a torch_dist
checkpoint by Megatron (bench/export/file_backed_checkpoint.py), its files fsync-ed and
dropped from the page cache (posix_fadvise), then exported by `megatron-async-export-hf` (the
default 5GB shards) in a child process whose private writable memory is capped by
setrlimit(RLIMIT_DATA): the heap and every anonymous mapping, which is where tensors live.
RLIMIT_AS (`--limit-kind as`) caps address space instead, which here includes 2.8 GB of
CUDA libraries torch maps and never touches, so it measures the build of torch more than the
export. Recorded: the child's peak RSS (its ru_maxrss), wall time, the largest group it
must hold (a layer; the embedding), the model's bytes, the files written; a control child
under the same limit allocating the model's bytes must fail, and so must an export that
reads every group before writing any (`--hold`, the export of tests/support/export_live_bytes.py).
Also the peak RSS of a child that only imports what the export imports, and the disk's
uncached read rate (the checkpoint's files read once). The checkpoint and export of each
size are removed after it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import emit

SIZES = ("16x8", "64x4", "32x40")  # layers of 0.11, 0.41 and 0.21 GB; models of 1.0, 1.8 and 8.5 GB
HIDDEN, MOE_FFN, VOCAB = 1024, 1024, 32000
LIMITS = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS}


def group_bytes(experts: int, layers: int, hidden: int = HIDDEN, moe_ffn: int = MOE_FFN, vocab: int = VOCAB,
                heads: int = HIDDEN // 128) -> dict:
    """Bytes (bf16) of one MoE layer (attention, QK and layer norms, router, SwiGLU experts), of
    the embedding (the vocabulary as Megatron pads it) and of the untied model."""
    attention = 4 * heads * 128 * hidden + 2 * 128 + 2 * hidden
    layer = attention + experts * hidden + experts * 3 * moe_ffn * hidden
    embedding = -(-(vocab + 1) // 128) * 128 * hidden  # NullTokenizer's end of document, padded to 128
    return {"layer": 2 * layer, "embedding": 2 * embedding, "model": 2 * (layers * layer + 2 * embedding + hidden)}


def _child(argv: list[str], log: Path, limit: int | None, kind: str) -> dict:
    """Run `argv` with its memory capped; its exit code, wall time and peak RSS (ru_maxrss)."""
    def cap():
        if limit is not None:
            resource.setrlimit(LIMITS[kind], (limit, limit))

    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=cap)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"code": proc.returncode, "wall_s": time.perf_counter() - start, "peak_rss": usage.ru_maxrss * 1024,
            "cpu_s": usage.ru_utime + usage.ru_stime}


def _tensor_bytes(path: Path) -> int:
    """The bytes of a safetensors file's tensors (the file less its header)."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def _uncache(folder: Path) -> int:
    """fsync every file under `folder` and drop it from the page cache; returns its bytes."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            total += path.stat().st_size
    return total


def _read_rate(folder: Path) -> float:
    """Bytes a second of reading `folder`'s files once from disk (uncached first)."""
    total = _uncache(folder)
    start = time.perf_counter()
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass
    rate = total / (time.perf_counter() - start)
    _uncache(folder)
    return rate


def run_size(spec: str, work: Path, limit: int, kind: str) -> dict:
    experts, layers = (int(x) for x in spec.split("x"))
    ckpt, out = work / f"ckpt-{spec}", work / f"hf-{spec}"
    py = sys.executable
    made = _child([py, "-m", "bench.export.file_backed_checkpoint", str(ckpt), "--layers", str(layers),
                   "--experts", str(experts), "--hidden", str(HIDDEN), "--moe-ffn", str(MOE_FFN),
                   "--vocab", str(VOCAB), "--pool", str(work / "pool.bin")], work / f"make-{spec}.log", None, kind)
    if made["code"] != 0:
        raise SystemExit(f"writing the {spec} checkpoint failed: see {work / f'make-{spec}.log'}")
    sizes = group_bytes(experts, layers)
    checkpoint_bytes = _uncache(ckpt)
    exported = _child([py, "-m", "megatron_async.megatron_lm.export.cli", "--load", str(ckpt), "--out", str(out)],
                      work / f"export-{spec}.log", limit, kind)
    files = sorted(p.name for p in out.glob("*.safetensors")) if out.is_dir() else []
    written = sum(_tensor_bytes(out / name) for name in files)
    held = _child([py, "-m", "tests.support.export_live_bytes", str(ckpt), str(work / f"held-{spec}"),
                   str(work / f"held-{spec}.json"), "--hold"], work / f"held-{spec}.log", limit, kind)
    allocation = _child([py, "-c", f"import torch; torch.empty({sizes['model']}, dtype=torch.uint8).fill_(1)"],
                        work / f"alloc-{spec}.log", limit, kind)
    if exported["code"] == 0 and written != sizes["model"]:
        raise SystemExit(f"{spec}: the export wrote {written} bytes of weights, the size's count is {sizes['model']}")
    result = {"size": spec, "experts": experts, "layers": layers, "model_bytes": sizes["model"],
              "layer_bytes": sizes["layer"], "embedding_bytes": sizes["embedding"],
              "checkpoint_bytes": checkpoint_bytes, "written_bytes": written, "files": files,
              "export": exported, "holding_every_group": held, "model_sized_allocation": allocation,
              "make_wall_s": made["wall_s"]}
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / f"held-{spec}", ignore_errors=True)
    return result


def _imports_only(work: Path, limit: int, kind: str) -> dict:
    code = ("import transformers, megatron.training.arguments; "
            "from megatron_async.megatron_lm.export import cli, checkpoint_stream, hf_weights")
    return _child([sys.executable, "-c", code], work / "imports.log", limit, kind)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + k x (NaN where the x do not differ)."""
    if len({x for x, _ in points}) < 2:
        return float("nan"), float("nan")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    k = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - k * mx, k


def fits(rows: list[dict]) -> dict:
    """Peak RSS against the largest group, and wall time against the model's bytes, over the
    sizes that exported."""
    done = [r for r in rows if r["export"]["code"] == 0]
    a, k = _line([(max(r["layer_bytes"], r["embedding_bytes"]), r["export"]["peak_rss"]) for r in done])
    t0, per_byte = _line([(r["model_bytes"], r["export"]["wall_s"]) for r in done])
    return {"rss_a": a, "rss_k": k, "time_s0": t0, "bytes_per_s": 1 / per_byte if per_byte > 0 else float("nan")}


def project_10b(fit: dict, read_rate: float) -> dict:
    """The 10B MoE's export (examples/moe_10b: 10.28B parameters in bf16, 64 experts of FFN 1024
    at hidden 2048, 16 heads, a 50,304-token vocabulary; one checkpoint with its optimizer state
    and stash 421.1 GB, as examples/moe_10b/plan.sh prints) from the fits, and the checksum
    pass over every file of the checkpoint at the disk's uncached read rate."""
    sizes = group_bytes(64, 24, hidden=2048, vocab=50303, heads=16)
    largest = max(sizes["layer"], sizes["embedding"])
    return {**sizes, "largest_group": largest, "checkpoint_bytes": 421.1e9,
            "peak_rss": fit["rss_a"] + fit["rss_k"] * largest,
            "export_s": fit["time_s0"] + sizes["model"] / fit["bytes_per_s"],
            "checksum_pass_s": 421.1e9 / read_rate}


def table(result: dict) -> str:
    gb = 1e9
    lines = [f"limit: RLIMIT_{result['limit_kind'].upper()} {result['limit'] / 2**30:.1f} GiB; a child that only "
             f"imports the export's modules peaks at {result['imports_only']['peak_rss'] / gb:.2f} GB RSS",
             "| size | model GB | largest group GB | x limit | peak RSS GB | export s | files | "
             "model-sized allocation | every group held |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["sizes"]:
        e = r["export"]
        lines.append(f"| {r['size']} | {r['model_bytes'] / gb:.2f} | {max(r['layer_bytes'], r['embedding_bytes']) / gb:.3f}"
                     f" | {r['model_bytes'] / result['limit']:.1f} | {e['peak_rss'] / gb:.2f}"
                     f"{'' if e['code'] == 0 else ' (failed)'} | {e['wall_s']:.1f} | {len(r['files'])} | "
                     f"{'refused' if r['model_sized_allocation']['code'] != 0 else 'FITS'} | "
                     f"{'refused' if r['holding_every_group']['code'] != 0 else 'FITS'} |")
    p, f = result["projection_10b"], result["fit"]
    lines.append(f"fits: peak RSS = {f['rss_a'] / gb:.2f} GB + {f['rss_k']:.2f} x largest group; export time = "
                 f"{f['time_s0']:.1f} s + model bytes at {f['bytes_per_s'] / gb:.2f} GB/s; uncached disk read "
                 f"{result['read_rate'] / gb:.2f} GB/s")
    lines.append(f"10B MoE ({p['model'] / gb:.1f} GB, one layer {p['layer'] / gb:.2f} GB): peak RSS "
                 f"{p['peak_rss'] / gb:.1f} GB, export {p['export_s'] / 60:.1f} min, plus the checksum pass over "
                 f"the {p['checkpoint_bytes'] / gb:.0f} GB checkpoint {p['checksum_pass_s'] / 60:.1f} min")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help="EXPERTSxLAYERS,... (default %(default)s)")
    p.add_argument("--limit-gib", type=float, default=2.5)
    p.add_argument("--limit-kind", choices=sorted(LIMITS), default="data")
    p.add_argument("--work", default=None, help="a folder for the checkpoints (default: a temporary one)")
    p.add_argument("--json", default=None)
    o = p.parse_args(argv)
    limit = int(o.limit_gib * 2**30)
    work = Path(o.work or tempfile.mkdtemp(prefix="export-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in o.sizes.split(","):
        rows.append(run_size(spec, work, limit, o.limit_kind))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "files"}), flush=True)
    read_rate = _measure_read_rate(work)
    result = {"limit": limit, "limit_kind": o.limit_kind, "imports_only": _imports_only(work, limit, o.limit_kind),
              "sizes": rows, "fit": fits(rows), "read_rate": read_rate,
              "command": " ".join([os.path.basename(sys.executable), "-m", "bench.export.export_memory",
                                   *(argv if argv is not None else sys.argv[1:])])}
    result["projection_10b"] = project_10b(result["fit"], read_rate)
    return emit(result, table(result), o.json)


def _measure_read_rate(work: Path) -> float:
    """The disk's uncached read rate, over a 2 GB file written here and removed."""
    path = work / "read-rate"
    path.mkdir(exist_ok=True)
    block = os.urandom(16 << 20)
    with open(path / "data", "wb") as f:
        for _ in range(128):
            f.write(block)
    rate = _read_rate(path)
    shutil.rmtree(path)
    return rate


if __name__ == "__main__":
    main()
