# shellcheck shell=bash
# Service bootstrap shared by scripts/test and scripts/demo: make sure the
# programs and services idem's tests and demo need are installed (apt, when
# missing and we are root) and, for PostgreSQL, running and reachable.
#
# Source it; it defines functions only and changes nothing by itself:
#   ensure_mosquitto   the mosquitto binary (tests start private brokers)
#   ensure_postgres    server binaries + a reachable cluster at DATABASE_URL
#   ensure_prometheus  promtool/prometheus installed (never started here)
#   ensure_nextest     cargo-nextest, the test runner (installed when missing or too old)
#
# Every function is idempotent: on a machine that already has everything it
# only checks and prints one line per service.

IDEM_DEFAULT_DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres"

svc_log() { printf '==> %s\n' "$*" >&2; }
svc_die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

svc_is_root() { [ "$(id -u)" -eq 0 ]; }

_svc_apt_updated=""

# apt_install PKG...: installs Debian packages, or explains what to run when
# we are not root.
svc_apt_install() {
  if ! svc_is_root; then
    svc_die "missing packages: $*. Install them with: sudo apt-get update && sudo apt-get install -y $* (or run this script as root)"
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    svc_die "missing packages: $*, and apt-get is not available: install them with your system's package manager"
  fi
  if [ -z "$_svc_apt_updated" ]; then
    svc_log "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    _svc_apt_updated=1
  fi
  svc_log "apt-get install -y $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}

# --- Mosquitto --------------------------------------------------------------

svc_find_mosquitto() {
  if command -v mosquitto 2>/dev/null; then
    return 0
  fi
  if [ -x /usr/sbin/mosquitto ]; then
    echo /usr/sbin/mosquitto
    return 0
  fi
  return 1
}

# The tests start their own private brokers on free ports, so only the
# binary is needed; the system broker on 1883 need not run.
ensure_mosquitto() {
  local bin
  if ! bin="$(svc_find_mosquitto)"; then
    svc_apt_install mosquitto mosquitto-clients
    bin="$(svc_find_mosquitto)" || svc_die "mosquitto is still missing after installing it"
  fi
  svc_log "mosquitto: $bin"
}

# --- PostgreSQL -------------------------------------------------------------

# Prints the directory holding initdb, pg_ctl and postgres (PATH first, then
# the newest /usr/lib/postgresql/*/bin), as the test harness looks for them.
svc_pg_bin_dir() {
  local initdb dir
  if initdb="$(command -v initdb 2>/dev/null)"; then
    dir="$(dirname "$(readlink -f "$initdb")")"
    if [ -x "$dir/pg_ctl" ] && [ -x "$dir/postgres" ]; then
      echo "$dir"
      return 0
    fi
  fi
  while IFS= read -r dir; do
    if [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ] && [ -x "$dir/postgres" ]; then
      echo "$dir"
      return 0
    fi
  done < <(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V -r)
  return 1
}

# Newest installed major version of the Debian packaging, e.g. 15.
svc_pg_version() {
  find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -type d -printf '%f\n' 2>/dev/null | sort -V | tail -n 1
}

# Whether DATABASE_URL (or the default) accepts a password-less query.
svc_pg_query_ok() {
  PGCONNECT_TIMEOUT=5 psql -X -w -q -At -d "$1" -c 'SELECT 1' >/dev/null 2>&1
}

# Waits up to 30 s for the server at host/port to accept connections.
svc_pg_wait_ready() {
  local i
  for i in $(seq 1 60); do
    if pg_isready -q -h "$1" -p "$2" -t 1; then
      return 0
    fi
    sleep 0.5
  done
  return 1
}

# Starts the Debian cluster `<version> main`, creating it when it is absent.
svc_pg_start_debian_cluster() {
  local version="$1"
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    svc_die "PostgreSQL is installed but not running, and pg_ctlcluster (postgresql-common) is missing: start PostgreSQL on 127.0.0.1:5432 yourself"
  fi
  svc_is_root || svc_die "PostgreSQL is not running on 127.0.0.1:5432: start it with: sudo pg_ctlcluster --skip-systemctl-redirect $version main start"
  if [ ! -d "/etc/postgresql/$version/main" ]; then
    svc_log "creating PostgreSQL cluster $version/main"
    pg_createcluster "$version" main
  fi
  svc_log "starting PostgreSQL cluster $version/main"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
}

# The block svc_pg_hba_trust_loopback puts at the top of pg_hba.conf.
IDEM_HBA_MARKER="# idem scripts/lib/services.sh: trust user postgres on loopback (tests)"

# svc_pg_hba_trust_loopback FILE: puts a marked block trusting user postgres
# on 127.0.0.1 and ::1 at the top of FILE (first match wins), once; keeps a
# one-time backup of the original as FILE.idem-backup. Idempotent.
svc_pg_hba_trust_loopback() {
  local hba="$1"
  if grep -qF "$IDEM_HBA_MARKER" "$hba"; then
    svc_log "pg_hba.conf already trusts postgres on loopback ($hba)"
    return 0
  fi
  svc_log "allowing password-less logins for user postgres on loopback in $hba"
  [ -e "$hba.idem-backup" ] || cp -p "$hba" "$hba.idem-backup"
  {
    echo "$IDEM_HBA_MARKER"
    echo "host    all    postgres    127.0.0.1/32    trust"
    echo "host    all    postgres    ::1/128         trust"
    echo "# end of idem block"
    cat "$hba"
  } >"$hba.idem-new"
  chown --reference="$hba" "$hba.idem-new"
  chmod --reference="$hba" "$hba.idem-new"
  mv "$hba.idem-new" "$hba"
}

# On a fresh Debian cluster, TCP logins from 127.0.0.1 need a password. The
# tests log in as `postgres` without one, so trust exactly that user on the
# loopback addresses, then reload the server.
svc_pg_trust_loopback() {
  local hba
  svc_is_root || svc_die "PostgreSQL at 127.0.0.1:5432 refuses password-less logins for user postgres: allow them (pg_hba.conf: host all postgres 127.0.0.1/32 trust) or set DATABASE_URL with a password"
  # The local socket uses peer auth on Debian, so the postgres OS user can ask.
  hba="$(runuser -u postgres -- psql -X -At -c 'SHOW hba_file' 2>/dev/null || true)"
  if [ -z "$hba" ]; then
    hba="/etc/postgresql/$(svc_pg_version)/main/pg_hba.conf"
  fi
  [ -f "$hba" ] || svc_die "cannot find pg_hba.conf (tried $hba) to allow password-less logins for user postgres on 127.0.0.1"
  svc_pg_hba_trust_loopback "$hba"
  runuser -u postgres -- psql -X -q -At -c 'SELECT pg_reload_conf()' >/dev/null ||
    pg_ctlcluster --skip-systemctl-redirect "$(svc_pg_version)" main reload
}

# Server binaries (the fault tests build private clusters with initdb and
# pg_ctl) and a reachable, password-less server at DATABASE_URL (default: the
# local cluster on 127.0.0.1:5432, started or created when needed).
ensure_postgres() {
  local url="${DATABASE_URL:-$IDEM_DEFAULT_DATABASE_URL}" bin_dir version
  if ! bin_dir="$(svc_pg_bin_dir)" || ! command -v pg_isready >/dev/null 2>&1 || ! command -v psql >/dev/null 2>&1; then
    svc_apt_install postgresql
    bin_dir="$(svc_pg_bin_dir)" || svc_die "initdb/pg_ctl still not found after installing postgresql"
  fi
  svc_log "postgres server binaries: $bin_dir"
  if svc_is_root && ! id -u postgres >/dev/null 2>&1; then
    svc_die "user postgres does not exist (private test clusters run as it): reinstall the postgresql package"
  fi

  if [ "$url" != "$IDEM_DEFAULT_DATABASE_URL" ]; then
    # Someone else's server: check it, never manage it.
    svc_pg_query_ok "$url" || svc_die "PostgreSQL at DATABASE_URL=$url does not answer a password-less query: start it, fix the URL, or unset DATABASE_URL to use the local cluster"
    svc_log "postgres: $url reachable"
    return 0
  fi

  version="$(svc_pg_version)"
  if ! pg_isready -q -h 127.0.0.1 -p 5432 -t 3; then
    svc_pg_start_debian_cluster "$version"
    svc_pg_wait_ready 127.0.0.1 5432 || {
      command -v pg_lsclusters >/dev/null 2>&1 && pg_lsclusters >&2
      svc_die "PostgreSQL did not come up on 127.0.0.1:5432 (see the cluster log under /var/log/postgresql)"
    }
  fi
  if ! svc_pg_query_ok "$url"; then
    svc_pg_trust_loopback
    svc_pg_query_ok "$url" || svc_die "PostgreSQL on 127.0.0.1:5432 still refuses a password-less login as postgres"
  fi
  svc_log "postgres: $url reachable"
}

# --- Prometheus -------------------------------------------------------------

# Installs Debian's prometheus (provides prometheus and promtool). Never
# starts it: callers run their own instance with their own config. While
# installing, a policy-rc.d (only if none exists) stops the package's
# maintainer scripts from starting the system service.
ensure_prometheus() {
  if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    svc_log "prometheus: $(command -v prometheus)"
    return 0
  fi
  local policy=/usr/sbin/policy-rc.d added_policy=""
  if svc_is_root && [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# added by idem scripts/lib/services.sh while installing prometheus\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    added_policy=1
  fi
  local status=0
  svc_apt_install prometheus || status=$?
  if [ -n "$added_policy" ]; then
    rm -f "$policy"
  fi
  [ "$status" -eq 0 ] || svc_die "installing prometheus failed"
  command -v promtool >/dev/null 2>&1 || svc_die "promtool is still missing after installing prometheus"
  svc_log "prometheus: $(command -v prometheus)"
}

# --- cargo-nextest ----------------------------------------------------------

# The test runner scripts/test uses (one process per test, a wall-clock
# limit per test: .config/nextest.toml). Any 0.9 release from
# $IDEM_NEXTEST_MIN on reads the profile alike; when none is installed,
# $IDEM_NEXTEST_VERSION is.
IDEM_NEXTEST_MIN="0.9.143"
IDEM_NEXTEST_VERSION="0.9.151"

# nextest_usable VERSION: a 0.9 release at or past $IDEM_NEXTEST_MIN.
nextest_usable() {
  local patch="${1#0.9.}" min="${IDEM_NEXTEST_MIN#0.9.}"
  case "$1" in
    0.9.*) [[ "$patch" =~ ^[0-9]+$ ]] && [ "$patch" -ge "$min" ] ;;
    *) return 1 ;;
  esac
}

# The version `cargo nextest --version` names, if it runs.
nextest_version() {
  cargo nextest --version 2>/dev/null | head -n 1 | awk '$1 == "cargo-nextest" {print $2}' || true
}

# Uses the cargo-nextest installed when it is recent enough; otherwise
# installs $IDEM_NEXTEST_VERSION with `cargo install --locked` (built from
# crates.io, without its self-update feature).
ensure_nextest() {
  local have=""
  have="$(nextest_version)"
  if nextest_usable "$have"; then
    svc_log "cargo-nextest: $have"
    return 0
  fi
  svc_log "cargo install cargo-nextest --version $IDEM_NEXTEST_VERSION --locked (found: ${have:-none}, need $IDEM_NEXTEST_MIN or newer; a few minutes, once)"
  cargo install cargo-nextest --version "$IDEM_NEXTEST_VERSION" --locked \
    --no-default-features --features default-no-update ||
    svc_die "installing cargo-nextest $IDEM_NEXTEST_VERSION failed (it needs crates.io and a Rust toolchain of 1.91 or newer)"
  have="$(nextest_version)"
  nextest_usable "$have" ||
    svc_die "cargo nextest --version says '${have:-nothing}' after installing $IDEM_NEXTEST_VERSION: is ~/.cargo/bin on PATH?"
  svc_log "cargo-nextest: $have"
}
