"""CPU threads: how many the engine runs, and pinning them one per core.

libgomp applies ``GOMP_CPU_AFFINITY`` when torch loads it, and from then on the main thread is
bound to the first CPU of that list: ``os.sched_getaffinity`` says one CPU although the OpenMP
team may use them all. So the CPUs a process may use are read from that variable when it is
set, and from the affinity mask otherwise.
"""

from __future__ import annotations

import os

import torch


def parse_cpu_list(text: str) -> list[int]:
    """CPUs of a list such as ``"0 1"``, ``"0-3"`` or ``"0,2,4-6"`` (GOMP_CPU_AFFINITY's form)."""
    cpus: list[int] = []
    for part in text.replace(",", " ").split():
        first, _, last = part.partition("-")
        lo = int(first)
        hi = int(last.split(":")[0]) if last else lo
        cpus.extend(range(lo, hi + 1))
    return list(dict.fromkeys(cpus))


def allowed_cpus() -> list[int]:
    """The CPUs this process's OpenMP team may run on."""
    bound = os.environ.get("GOMP_CPU_AFFINITY", "").strip()
    if bound:
        try:
            return parse_cpu_list(bound)
        except ValueError:
            pass
    return sorted(os.sched_getaffinity(0))


def physical_cores(cpus: list[int] | None = None) -> list[int]:
    """One CPU per physical core among ``cpus`` (default: ``allowed_cpus()``).

    SMT siblings share a core's FPUs, so a GEMM-bound step gains nothing from them and loses
    to the synchronisation; ``/proc/cpuinfo``'s (physical id, core id) pairs tell them apart.
    """
    cpus = allowed_cpus() if cpus is None else cpus
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().split("\n\n")
    except OSError:
        return list(cpus)
    core_of: dict[int, tuple[str, str]] = {}
    for block in blocks:
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in block.splitlines())
        )
        if fields.get("processor", "").isdigit():
            cpu = int(fields["processor"])
            core_of[cpu] = (fields.get("physical id", "0"), fields.get("core id", str(cpu)))
    chosen: dict[tuple[str, str], int] = {}
    for cpu in cpus:
        chosen.setdefault(core_of.get(cpu, ("?", str(cpu))), cpu)
    return sorted(chosen.values()) or list(cpus)


def default_num_threads() -> int:
    """``OMP_NUM_THREADS`` when the user set it, else one thread per physical core."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(physical_cores())


def apply_num_threads(num_threads: int | None, device: torch.device) -> int:
    """Set torch's intra-op threads for a CPU engine (``None`` = the default); returns it."""
    if device.type != "cpu":
        return torch.get_num_threads()
    wanted = num_threads or default_num_threads()
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return wanted


def bind_env(num_threads: int | None = None) -> dict[str, str]:
    """Environment that pins a child's OpenMP threads one per physical core, as vLLM pins its own.

    On a shared host an unpinned OpenMP thread that gets descheduled stalls its partner at every
    barrier. Empty when fewer threads than cores are wanted (several processes share the host,
    and pinning each to the first cores would stack them).
    """
    cores = physical_cores()
    threads = num_threads or default_num_threads()
    if threads != len(cores):
        return {}
    return {"GOMP_CPU_AFFINITY": " ".join(map(str, cores)), "OMP_NUM_THREADS": str(threads)}
