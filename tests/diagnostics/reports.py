"""One inspection per target for the whole test run: every test that asks about a family reads the same report."""

from __future__ import annotations

import functools

from fastdit.diagnostics.inspect import InspectReport, inspect_target
from fastdit.diagnostics.target import Target, resolve_target


@functools.cache
def report_for(spec: str) -> InspectReport:
    """The (cached) report of ``spec``."""
    return inspect_target(spec)


@functools.cache
def target_for(spec: str) -> Target:
    """The resolved target of ``spec`` (its config is the full-size one the report read)."""
    report_for(spec)
    return resolve_target(spec)
