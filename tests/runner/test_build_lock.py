"""A build lock left by a killed build is removed; a recent one (a build may be running) is kept."""

from __future__ import annotations

import os
import time

from tokenflow_ray.layers.cpu_kernels import STALE_BUILD_LOCK_S, drop_stale_build_lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not drop_stale_build_lock(tmp_path)  # no lock: nothing to do
    lock.touch()
    assert not drop_stale_build_lock(tmp_path) and lock.exists()  # another process may be building
    old = time.time() - STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    assert drop_stale_build_lock(tmp_path) and not lock.exists()
