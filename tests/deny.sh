#!/usr/bin/env bash
# The dependency policy (deny.toml): licenses, bans and sources always; the RustSec
# advisories when their database can be fetched — and a line saying they were NOT
# checked when it cannot (no network to it). cargo-deny comes from tests/setup.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo deny --version
# Without the inclusion graphs (which crate pulls which in: run without
# --hide-inclusion-graph to see them).
cargo deny --locked check --hide-inclusion-graph licenses bans sources
# The database is a git repository (github.com/rustsec/advisory-db), fetched into
# $CARGO_HOME/advisory-dbs; bounded, so an unreachable host cannot stall CI.
if GIT_TERMINAL_PROMPT=0 timeout 180 cargo deny --locked fetch db; then
    cargo deny --locked --offline check --hide-inclusion-graph advisories
else
    echo "tests/deny.sh: the advisory database could not be fetched: advisories NOT checked (licenses, bans and sources were)"
fi
