#!/usr/bin/env bash
# Forwards to lab/studies/study_a.sh (the paper studies moved to lab/), with the same
# arguments and environment: kept so that `bash benchmarks/studies/study_a.sh` works as documented.
exec bash "$(dirname "$0")/../../lab/studies/study_a.sh" "$@"
