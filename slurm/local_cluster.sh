#!/usr/bin/env bash
# A real single-node Slurm on this machine, for CI and development (Debian 12, root, no systemd).
#
#   slurm/local_cluster.sh start    install the Debian packages when missing, write the config,
#                                   start munged, MariaDB, slurmdbd, slurmctld and slurmd, wait
#                                   until the node is idle; a second start only checks
#   slurm/local_cluster.sh stop     stop the daemons this script started (by PID); packages stay
#   slurm/local_cluster.sh status   exit 0 when sinfo answers and the node can run jobs
#
# State (config copies, spool, logs, PID files, the accounting database) lives in SLURM_LOCAL_DIR
# (default /tmp/moe-train-slurm): slurmctld's job counter and sacct's records live and go
# together, so a fresh state never reuses a job ID that an older record in sacct still holds. Debian's Slurm reads /etc/slurm/slurm.conf and /etc/slurm/slurmdbd.conf,
# so `start` writes those two files too: only run it on a CI or development machine.
# SLURM_LOCAL_TIMEOUT (seconds, default 60) bounds every wait.
set -euo pipefail

STATE="${SLURM_LOCAL_DIR:-/tmp/moe-train-slurm}"
TIMEOUT="${SLURM_LOCAL_TIMEOUT:-60}"
CLUSTER=moetrain
PARTITION=debug
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
SLURM_CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
MARKER="# written by moe-train slurm/local_cluster.sh"
DB_NAME=slurm_acct_db
DB_USER=slurm
MYSQL_SOCKET=/run/mysqld/mysqld.sock
DB_DIR="$STATE/mysql"
# start order; stop goes backwards
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)

say() { echo "slurm: $*"; }
die() { echo "slurm: error: $*" >&2; exit 1; }

need_root() {
    [[ $(id -u) -eq 0 ]] || die "'$1' must run as root (it installs packages, writes /etc/slurm and starts daemons); try: sudo $0 $1"
}

short_host() { hostname -s; }

# --- daemons and their PID files -----------------------------------------------------------

pidfile() { echo "$STATE/pids/$1.pid"; }

# the PID this script recorded for daemon $1 when it is still that daemon, else nothing
our_pid() {
    local f pid
    f=$(pidfile "$1")
    [[ -f $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm && $(</proc/$pid/comm) == "$1" ]] && alive "$pid" || return 1
    echo "$pid"
}

# alive PID: the process exists and is not a zombie (PID 1 here reaps orphans only now and then)
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]]
}

# some live process is named $1, whoever started it
named_alive() {
    local pid
    for pid in $(pgrep -x "$1"); do alive "$pid" && return 0; done
    return 1
}

# daemon $1 runs, whoever started it
running() { our_pid "$1" >/dev/null || named_alive "$1"; }

log_tail() {
    local f
    for f in "$@"; do
        [[ -s $f ]] || continue
        echo "---- last lines of $f" >&2
        tail -n 25 "$f" >&2
    done
}

# launch NAME LOG CMD...: start a daemon in the foreground of its own session, record its PID
launch() {
    local name=$1 log=$2
    shift 2
    setsid "$@" </dev/null >>"$log" 2>&1 &
    local pid=$!
    echo "$pid" >"$(pidfile "$name")"
    sleep 0.2
    if ! alive "$pid"; then
        log_tail "$log"
        die "$name exited at once (log: $log)"
    fi
}

# wait_for DESC DAEMON LOGS CMD...: run CMD until it succeeds; fail when DAEMON dies or time runs out
wait_for() {
    local desc=$1 daemon=$2 logs=$3
    shift 3
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        if [[ -n $daemon ]] && ! running "$daemon"; then
            # shellcheck disable=SC2086
            log_tail $logs
            die "$daemon died while waiting for $desc"
        fi
        if ((SECONDS >= deadline)); then
            # shellcheck disable=SC2086
            log_tail $logs
            die "timed out after ${TIMEOUT}s waiting for $desc"
        fi
        sleep 0.3
    done
}

# --- packages -------------------------------------------------------------------------------

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true) == "install ok installed" ]] \
            || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >"$STATE/log/apt.log" 2>&1 || { log_tail "$STATE/log/apt.log"; die "apt-get update failed"; }
    # postinst scripts cannot start services here (policy-rc.d): harmless, we start them below
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >>"$STATE/log/apt.log" 2>&1 \
        || { log_tail "$STATE/log/apt.log"; die "apt-get install failed (log: $STATE/log/apt.log)"; }
}

# --- configuration --------------------------------------------------------------------------

ensure_hostname_resolves() {
    local host=$1
    if ! getent hosts "$host" >/dev/null; then
        say "adding '127.0.0.1 $host' to /etc/hosts (the node name must resolve)"
        echo "127.0.0.1 $host" >>/etc/hosts
    fi
}

# write_if_changed FILE OWNER MODE: stdin -> FILE; returns 0 when the content changed
write_if_changed() {
    local file=$1 owner=$2 mode=$3 tmp
    tmp=$(mktemp "$STATE/.conf.XXXXXX")
    cat >"$tmp"
    if [[ -f $file ]] && cmp -s "$tmp" "$file"; then
        rm -f "$tmp"
        chown "$owner" "$file"
        chmod "$mode" "$file"
        return 1
    fi
    if [[ -f $file ]] && ! grep -qxF "$MARKER" "$file"; then
        cp -p "$file" "$file.orig.$(date +%s)"
        say "kept the previous $file as $file.orig.*"
    fi
    chown "$owner" "$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$file"
    return 0
}

# the node line from `slurmd -C`, RealMemory lowered to 90% (above what slurmd detects: INVAL)
node_line() {
    local line
    line=$(slurmd -C 2>/dev/null | grep -m1 '^NodeName=') || die "slurmd -C printed no NodeName line"
    awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^RealMemory=/) { split($i, kv, "="); $i = "RealMemory=" int(kv[2] * 0.9) } print }' <<<"$line"
}

db_password() {
    local f="$STATE/dbpass"
    if [[ ! -s $f ]]; then
        (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$f")
    fi
    cat "$f"
}

write_configs() {
    local host=$1 node
    node=$(node_line)
    mkdir -p /etc/slurm
    SLURM_CONF_CHANGED=0
    write_if_changed "$SLURM_CONF" root:root 644 <<EOF && SLURM_CONF_CHANGED=1 || true
$MARKER
# state: $STATE
ClusterName=$CLUSTER
SlurmctldHost=$host
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# the default proctrack/cgroup fails silently without cgroups: jobs "complete" without running
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$host
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
# one failed rank ends the step at once; submitit ignores SIGTERM, so do not wait 30 s for it
KillOnBadExit=1
KillWait=5
MailProg=/bin/true
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
$node
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    # slurmdbd refuses a config that is not owned by SlurmUser with mode 600
    write_if_changed "$DBD_CONF" slurm:slurm 600 <<EOF || true
$MARKER
AuthType=auth/munge
DbdHost=$host
DbdPort=6819
SlurmUser=slurm
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$(db_password)
StorageLoc=$DB_NAME
EOF
    cp -f "$SLURM_CONF" "$STATE/slurm.conf"
}

make_dirs() {
    mkdir -p "$STATE"/{pids,log,run,slurmctld,slurmd}
    chmod 755 "$STATE"
    chmod 700 "$STATE/pids"
    chown slurm:slurm "$STATE/run" "$STATE/slurmctld"
    local f
    for f in slurmctld slurmdbd; do
        touch "$STATE/log/$f.log"
        chown slurm:slurm "$STATE/log/$f.log"
    done
    touch "$STATE/log/mariadb.log"
    chown mysql:mysql "$STATE/log/mariadb.log"
    mkdir -p /run/munge /run/mysqld
    chown munge:munge /run/munge
    chown mysql:mysql /run/mysqld
}

# --- the daemons ----------------------------------------------------------------------------

start_munge() {
    if running munged; then return 0; fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        setpriv --reuid=munge --regid=munge --init-groups mungekey --create >/dev/null
    fi
    launch munged "$STATE/log/munged.out" setpriv --reuid=munge --regid=munge --init-groups munged -F
    wait_for "munged" munged "$STATE/log/munged.out /var/log/munge/munged.log" \
        bash -c 'munge -n </dev/null | unmunge'
}

mysql_cmd() { mariadb --protocol=socket -S "$MYSQL_SOCKET" -u root "$@"; }

start_mariadb() {
    if ! running mariadbd; then
        if [[ ! -d $DB_DIR/mysql ]]; then
            say "initialising MariaDB's data directory $DB_DIR"
            install -d -o mysql -g mysql -m 700 "$DB_DIR"
            mariadb-install-db --user=mysql --datadir="$DB_DIR" >>"$STATE/log/mariadb.log" 2>&1 \
                || { log_tail "$STATE/log/mariadb.log"; die "mariadb-install-db failed"; }
        fi
        launch mariadbd "$STATE/log/mariadb.out" \
            mariadbd --user=mysql --datadir="$DB_DIR" --socket="$MYSQL_SOCKET" \
            --log-error="$STATE/log/mariadb.log"
    fi
    wait_for "MariaDB" mariadbd "$STATE/log/mariadb.out $STATE/log/mariadb.log" \
        mariadb-admin --protocol=socket -S "$MYSQL_SOCKET" -u root ping
    local pass
    pass=$(db_password)
    mysql_cmd <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$pass';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$pass';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
    running slurmdbd || launch slurmdbd "$STATE/log/slurmdbd.out" slurmdbd -D
    wait_for "slurmdbd" slurmdbd "$STATE/log/slurmdbd.out $STATE/log/slurmdbd.log" \
        sacctmgr -n -P list cluster
    if ! sacctmgr -n -P list cluster format=Cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

node_state() { sinfo -h -N -n "$(short_host)" -o '%T' 2>/dev/null | head -n1; }

# idle/mixed/allocated/completing, without a flag such as '*' (not responding) or '~'
node_ready() {
    case "$(node_state)" in
        idle | mixed | allocated | completing) return 0 ;;
        *) return 1 ;;
    esac
}

start_slurm() {
    local host=$1
    if running slurmctld; then
        # an already running slurmctld reads a changed slurm.conf only when told to
        [[ $SLURM_CONF_CHANGED == 1 ]] && scontrol reconfigure >/dev/null 2>&1 || true
    else
        launch slurmctld "$STATE/log/slurmctld.out" slurmctld -D
    fi
    wait_for "slurmctld (scontrol ping)" slurmctld "$STATE/log/slurmctld.out $STATE/log/slurmctld.log" ctld_up
    running slurmd || launch slurmd "$STATE/log/slurmd.out" slurmd -D
    # node state survives restarts: clear a stale DRAIN/DOWN left by an earlier run
    local deadline=$((SECONDS + TIMEOUT)) state
    until node_ready; do
        state=$(node_state)
        case "$state" in
            *drain* | down)
                say "node $host is $state ($(sinfo -h -N -n "$host" -o '%E' 2>/dev/null | head -n1)): resuming it"
                scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
                ;;
        esac
        if ! running slurmd; then
            log_tail "$STATE/log/slurmd.out" "$STATE/log/slurmd.log"
            die "slurmd died while waiting for node $host to become idle"
        fi
        if ((SECONDS >= deadline)); then
            log_tail "$STATE/log/slurmd.log" "$STATE/log/slurmctld.log"
            sinfo -N -l >&2 || true
            scontrol show node "$host" >&2 || true
            die "timed out after ${TIMEOUT}s waiting for node $host to become idle (state: ${state:-none})"
        fi
        sleep 0.3
    done
}

up_line() {
    local host cpus
    host=$(short_host)
    cpus=$(sinfo -h -N -n "$host" -o '%c' 2>/dev/null | head -n1)
    say "up (node $host, ${cpus:-?} CPUs, partition $PARTITION)"
}

all_running() {
    local d
    for d in "${DAEMONS[@]}"; do running "$d" || return 1; done
}

cmd_start() {
    need_root start
    local host
    host=$(short_host)
    if command -v sinfo >/dev/null && [[ -d $STATE/pids ]] && all_running && ctld_up && node_ready; then
        up_line
        return 0
    fi
    mkdir -p "$STATE/log"
    install_packages
    ensure_hostname_resolves "$host"
    make_dirs
    write_configs "$host"
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurm "$host"
    up_line
}

# stop_group DAEMON...: SIGTERM the ones this script started, wait (SIGKILL after 20 s)
stop_group() {
    local d pid pids=() deadline
    for d in "$@"; do
        if pid=$(our_pid "$d"); then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$d:$pid")
            STOPPED+=("$d")
        elif named_alive "$d"; then
            say "$d runs but was not started by this script: left alone"
        fi
        rm -f "$(pidfile "$d")"
    done
    deadline=$((SECONDS + 20))
    for d in "${pids[@]}"; do
        pid=${d#*:}
        while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
        if alive "$pid"; then
            say "${d%%:*} (pid $pid) ignored SIGTERM for 20 s: killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

cmd_stop() {
    need_root stop
    STOPPED=()
    # slurm first (slurmctld flushes to slurmdbd), then slurmdbd, then what it depends on
    stop_group slurmd slurmctld
    stop_group slurmdbd
    stop_group mariadbd munged
    say "stopped${STOPPED[*]:+ ${STOPPED[*]}}"
}

cmd_status() {
    command -v sinfo >/dev/null || { say "not installed (no sinfo on PATH)"; return 1; }
    local state
    state=$(timeout 10 sinfo -h -N -n "$(short_host)" -o '%T' 2>/dev/null | head -n1) || true
    if [[ -z $state ]]; then
        say "down (sinfo does not answer)"
        return 1
    fi
    case "$state" in
        idle | mixed | allocated | completing) up_line ;;
        *) say "node $(short_host) is $state"; return 1 ;;
    esac
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
