# PostgreSQL for the coordinator's database, from Debian's own package (no registry needed):
#   DOCKER_BUILDKIT=1 docker build -f docker/postgres.Dockerfile -t hydrafl-postgres docker/
# The password comes at run time from the file named by POSTGRES_PASSWORD_FILE (a compose secret) or from
# POSTGRES_PASSWORD; the database (POSTGRES_DB, owner POSTGRES_USER, both "hydrafl") is made on first start.
ARG BASE=hydrafl-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && rm -rf /var/lib/postgresql/15 /etc/postgresql/15 \
 && mkdir -p /var/lib/postgresql/data /run/postgresql \
 && chown -R postgres:postgres /var/lib/postgresql /run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
USER postgres
VOLUME /var/lib/postgresql/data
EXPOSE 5432
HEALTHCHECK --interval=5s --timeout=5s --retries=10 CMD ["pg_isready", "-q", "-h", "127.0.0.1", "-U", "postgres"]
ENTRYPOINT ["postgres-entrypoint"]
