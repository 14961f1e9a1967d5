#!/usr/bin/env bash
# Start or stop a private Docker engine for hora's tests, CI and benchmarks (needs root).
#
#   scripts/dockerd.sh start DIR   start dockerd with its state under DIR; prints DOCKER_HOST=...
#   scripts/dockerd.sh stop DIR    stop it (running containers are killed by the engine)
#
# No bridge and no iptables (this machine kind allows neither): containers use the host's
# network. The engine listens only on the unix socket DIR/docker.sock.
set -euo pipefail
cmd="${1:-}"; dir="${2:-}"
if [[ -z "$cmd" || -z "$dir" ]]; then
  echo "usage: $0 start|stop DIR" >&2; exit 2
fi
sock="$dir/docker.sock"
pidfile="$dir/dockerd.pid"
case "$cmd" in
  start)
    if [[ "$(id -u)" != 0 ]]; then echo "dockerd.sh: dockerd needs root" >&2; exit 1; fi
    command -v dockerd >/dev/null || { echo "dockerd.sh: dockerd is not installed (apt-get install docker.io)" >&2; exit 1; }
    mkdir -p "$dir/data" "$dir/exec"
    if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "DOCKER_HOST=unix://$sock"; exit 0
    fi
    dockerd --iptables=false --ip6tables=false --bridge=none \
      --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$pidfile" \
      -H "unix://$sock" >"$dir/dockerd.log" 2>&1 &
    for _ in $(seq 1 120); do
      if docker -H "unix://$sock" version >/dev/null 2>&1; then
        echo "DOCKER_HOST=unix://$sock"; exit 0
      fi
      sleep 0.5
    done
    echo "dockerd.sh: dockerd did not answer within 60 s; its log:" >&2
    tail -20 "$dir/dockerd.log" >&2
    exit 1
    ;;
  stop)
    pid="$(cat "$pidfile" 2>/dev/null || true)"
    if [[ -n "$pid" ]] && kill "$pid" 2>/dev/null; then
      for _ in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
      done
      kill -9 "$pid" 2>/dev/null || true
    fi
    # what the engine mounted under its exec root and left (its network namespace's nsfs
    # mount), so that DIR can be removed
    [[ -d "$dir" ]] || exit 0
    awk -v root="$(cd "$dir" && pwd -P)/exec/" 'index($2, root) == 1 { print $2 }' /proc/mounts \
      | while read -r mnt; do umount "$mnt" 2>/dev/null || true; done
    ;;
  *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
