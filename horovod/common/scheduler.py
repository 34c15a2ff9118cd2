"""Workers started by a scheduler instead of horovodrun: ``srun``, ``mpirun`` (Open MPI), or a
PMI launcher (MPICH/Intel MPI hydra). ``detect(environ)`` reads the scheduler's variables and
returns the ``HOROVOD_*`` settings they imply; ``hvd.init()`` then runs the rendezvous itself:
rank 0 serves the store at ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` (the one variable a job must set,
except under Slurm, where it defaults to the first node of the step), the others connect to it.

Variables read (the first complete set wins; ``HOROVOD_RANK`` set means horovodrun started the
worker and nothing is read):

==========  =========================  =====================  ===========================
scheduler   rank / size                local rank / size      job id (port, derived key)
==========  =========================  =====================  ===========================
Slurm       SLURM_PROCID /             SLURM_LOCALID /        SLURM_JOB_ID.SLURM_STEP_ID
            SLURM_STEP_NUM_TASKS       SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID
Open MPI    OMPI_COMM_WORLD_RANK/SIZE  OMPI_COMM_WORLD_LOCAL_RANK/_LOCAL_SIZE  OMPI_MCA_orte_ess_jobid
PMI         PMI_RANK / PMI_SIZE        MPI_LOCALRANKID / MPI_LOCALNRANKS       PMI_JOBID
Kubernetes  JOB_COMPLETION_INDEX /     0 / 1 (a pod each)     -
(Indexed    HOROVOD_SIZE
Job)
==========  =========================  =====================  ===========================

Slurm is recognised from an ``srun`` step only (``SLURM_STEP_NUM_TASKS``), not from the batch
script's own environment, so ``python train.py`` inside ``sbatch`` still runs as one process.

Must not touch: the environment it is given (it only reads), any layer above it.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

BASE_PORT = 28000


@dataclass(frozen=True)
class Launch:
    scheduler: str
    env: dict[str, str]  # HOROVOD_* settings to add to the worker's environment
    derived_secret: bool  # HOROVOD_SECRET_KEY was not given and was derived from the job id


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read Slurm's tasks per node {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[07-09,12],gpu1`` -> ``node07``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read Slurm's node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges, maxsplit=1)[0]


def _ints(environ: Mapping[str, str], *names: str) -> list[int] | None:
    try:
        return [int(environ[n]) for n in names]
    except (KeyError, ValueError):
        return None


def detect(environ: Mapping[str, str]) -> Launch | None:
    if environ.get("HOROVOD_RANK", "").strip():
        return None
    found = _slurm(environ) or _simple(environ) or _kubernetes(environ)
    if found is None:
        return None
    name, rank, size, local_rank, local_size, job, addr = found
    env = {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size),
    }
    derived = False
    if size > 1:
        if not environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") and addr:
            env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = addr
        if not environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT"):
            digits = int("".join(c for c in job if c.isdigit())[-6:] or 0)
            env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(BASE_PORT + digits % 2000)
        if not environ.get("HOROVOD_SECRET_KEY"):
            derived = True
            seed = f"pyhorovod/{name}/{job}/{os.getuid() if hasattr(os, 'getuid') else 0}"
            env["HOROVOD_SECRET_KEY"] = hashlib.sha256(seed.encode()).hexdigest()
    return Launch(name, env, derived)


def _slurm(environ: Mapping[str, str]):
    got = _ints(environ, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
    if got is None:
        return None
    rank, size, local_rank = got
    local_size = 1
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node = _ints(environ, "SLURM_NODEID")
    if per_node and node is not None:
        counts = tasks_per_node(per_node)
        if node[0] < len(counts):
            local_size = counts[node[0]]
    local_size = max(local_size, local_rank + 1)
    job = f"{environ.get('SLURM_JOB_ID', '')}.{environ.get('SLURM_STEP_ID', '')}"
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    addr = first_host(nodes) if nodes else ""
    return "Slurm", rank, size, local_rank, local_size, job, addr


def _kubernetes(environ: Mapping[str, str]):
    """An Indexed Job: one worker per pod, its index as rank; the manifest sets HOROVOD_SIZE
    (the number of completions) and the rendezvous address (pod 0's stable DNS name)."""
    got = _ints(environ, "JOB_COMPLETION_INDEX", "HOROVOD_SIZE")
    if got is None:
        return None
    return "Kubernetes", got[0], got[1], 0, 1, environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", ""), ""


def _simple(environ: Mapping[str, str]):
    for name, vars_, job_var in (
        (
            "Open MPI",
            (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
            "OMPI_MCA_orte_ess_jobid",
        ),
        ("PMI", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), "PMI_JOBID"),
    ):
        got = _ints(environ, *vars_[:2])
        if got is None:
            continue
        local = _ints(environ, *vars_[2:]) or [0, 1]
        rank, size = got
        return name, rank, size, local[0], max(local[1], local[0] + 1), environ.get(job_var, ""), ""
    return None
