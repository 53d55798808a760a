"""Names a job's processes derive from its secret, without importing torch (shoalrun uses them): the store's key
namespace and the job's shared-memory segments in /dev/shm."""

from __future__ import annotations

import hashlib
import os

SEGMENT_PREFIX = "shoal-"
SHM_DIR = "/dev/shm"


def secret_namespace(secret: str | None) -> str:
    """Key prefix derived from the secret (kept so that jobs sharing an open store stay apart)."""
    if secret is None:
        return "shoal/open"
    return "shoal/" + hashlib.sha256(secret.encode()).hexdigest()[:16]


def job_token(secret: str | None) -> str:
    """The per-job part of segment names; shoalrun derives the same token from the secret to clean up."""
    return hashlib.sha256(secret.encode()).hexdigest()[:12] if secret else "nojob"


def host_tag(host_key: str) -> str:
    """The per-host part of segment names (a digest: host names may hold characters a file name must not)."""
    return hashlib.sha256(host_key.encode()).hexdigest()[:8]


def remove_job_segments(token: str) -> list[str]:
    """Unlink every segment of job ``token`` left in /dev/shm (shoalrun calls this when a job ends)."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(f"{SEGMENT_PREFIX}{token}-"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed
