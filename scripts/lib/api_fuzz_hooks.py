"""Hooks for scripts/api-fuzz (schemathesis): the fuzzer must not revoke the
token it runs with, or every later call answers 401 and tests nothing; and
a link from a field that is null reaches a path as the text "None", which
is not an id the API ever answered with (the API leaves such fields out,
e.g. a run's `plan_id`, so this is a guard)."""

import os

import schemathesis

FUZZ_TOKEN_NAME = os.environ.get("IDEM_API_FUZZ_TOKEN_NAME", "fuzz")


@schemathesis.hook
def filter_path_parameters(ctx, path_parameters):
    if path_parameters is None:
        return True
    if path_parameters.get("id") == "None":
        return False
    return path_parameters.get("name") != FUZZ_TOKEN_NAME
