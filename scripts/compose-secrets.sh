#!/bin/sh
# The files compose.secrets.yaml mounts, in ${SPECDEC_SECRETS_DIR:-./secrets} (relative to the
# repository root, as compose reads it): a random value for each file that is missing. A file that
# exists is never changed (edit it, or delete it for a new value); no value is printed.
#
#   sh scripts/compose-secrets.sh
#   docker compose -f compose.yaml -f compose.secrets.yaml up
set -eu
cd "$(dirname "$0")/.."
dir=${SPECDEC_SECRETS_DIR:-./secrets}
umask 077
mkdir -p "$dir"
chmod 700 "$dir"  # other users of this host cannot reach the files

random() {  # $1 random bytes as hex digits
    od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'
}

create() {  # file name, contents
    if [ -e "$dir/$1" ]; then
        echo "kept     $dir/$1"
        return
    fi
    printf '%s\n' "$2" >"$dir/$1.new"
    # Docker mounts the file with its host owner and mode; the processes run as uid 10001.
    chmod 644 "$dir/$1.new"
    mv "$dir/$1.new" "$dir/$1"
    echo "created  $dir/$1"
}

create grpc-token "$(random 32)"
create api-keys "# API keys of the orchestrator, one per line (clients send Authorization: Bearer <key>)
$(random 32)"
# The dashboard sends the first of them.
create ui-api-key "$(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$dir/api-keys" | head -n 1 | tr -d '[:space:]')"
create ui-password "$(random 16)"
echo "the dashboard's password is in $dir/ui-password; start with:"
echo "  docker compose -f compose.yaml -f compose.secrets.yaml up"
