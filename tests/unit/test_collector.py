"""The garbage collector paused during a blocking save, and given back as it was."""

from __future__ import annotations

import gc

from ucformat.sysio.collector import collection_paused


def test_collection_paused_restores_the_callers_setting() -> None:
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller had it off: left off
    finally:
        gc.enable()
