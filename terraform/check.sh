#!/usr/bin/env bash
# Static security scan of the Terraform modules with checkov. Exits non-zero on
# any failed check; every accepted finding is suppressed inline in the .tf file
# with `#checkov:skip=CKV_...: reason`.
#
# checkov pins its own dependencies (an older boto3, packaging, and
# bc-python-hcl2, which installs the same `hcl2` module as python-hcl2), so keep
# it out of the project's venv:
#   python3 -m venv /tmp/checkov-venv && /tmp/checkov-venv/bin/pip install checkov
#   CHECKOV=/tmp/checkov-venv/bin/checkov bash terraform/check.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
checkov="${CHECKOV:-checkov}"
# --skip-download: no call to the Prisma Cloud API (offline, same results).
exec "$checkov" -d "$here" --framework terraform --quiet --compact --skip-download "$@"
