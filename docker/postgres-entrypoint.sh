#!/bin/sh
# First start: make the cluster and the hydrafl database with a password login from the network; then serve.
set -eu
user=${POSTGRES_USER:-hydrafl}
db=${POSTGRES_DB:-hydrafl}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    password=$(cat "$POSTGRES_PASSWORD_FILE")
  else
    password=${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD_FILE or POSTGRES_PASSWORD}
  fi
  initdb --auth-local=peer --auth-host=scram-sha-256 --encoding=UTF8 --username=postgres >/dev/null
  printf "listen_addresses = '*'\n" >> "$PGDATA/postgresql.conf"
  printf 'host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
  # Single-user mode: nothing listens while the role is made, and the password never appears in `ps`.
  printf "CREATE ROLE \"%s\" LOGIN PASSWORD '%s';\n" "$user" "$(printf %s "$password" | sed "s/'/''/g")" \
    | postgres --single -D "$PGDATA" postgres >/dev/null
  printf 'CREATE DATABASE "%s" OWNER "%s";\n' "$db" "$user" | postgres --single -D "$PGDATA" postgres >/dev/null
fi
exec postgres -D "$PGDATA"
