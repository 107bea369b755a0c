#!/usr/bin/env bash
# Forwards to lab/studies/study_b.sh (the paper studies moved to lab/), with the same
# arguments and environment: kept so that `bash benchmarks/studies/study_b.sh` works as documented.
exec bash "$(dirname "$0")/../../lab/studies/study_b.sh" "$@"
