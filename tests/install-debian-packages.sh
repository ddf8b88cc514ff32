#!/usr/bin/env bash
# Install the Debian packages of the programs ptckpt's tests use (run as root; Debian 12).
#
#   tests/install-debian-packages.sh
#
# Idempotent: installs only the packages whose programs are missing, and runs
# `apt-get update` only when apt does not know one of them yet.  A test whose program is
# missing is skipped, its reason naming the package (tests/conftest.py, needs()).
#
# What each package is for:
#   gcc, libc6-dev  compile the C fixtures (fixtures/*.c); only when no gcc can build a program
#   tmux            drives a pty for the terminal tests
#   util-linux      setpriv, nsenter, unshare, ipcrm (the unprivileged, namespace and SysV tests)
#   nftables        nft: the network lock that --tcp-established dumps take
#   redis-server    a real program the network tests checkpoint
#   vim, less       programs the terminal tests restore into a tmux pane (vim with timers)
#   procps          top, restored into a tmux pane too
#   gdb             reads the core files `ptckpt core` writes
#   mpich, libmpich-dev  mpicc and mpiexec, the MPI job tests/test_mpi.py checkpoints
#   iverilog        iverilog and vvp, the simulator tests/test_simulators.py checkpoints
#   iproute2        ip and ss (named network namespaces, connection listings)
#   gcc-multilib    gcc -m32: the 32-bit builds of the C fixtures (tests/test_compat32.py, the -m32 cases)
# A Debian install starts the packaged redis service; the tests start their own, so the
# service is stopped.
set -euo pipefail

say() { printf '==> %s\n' "$*"; }

# package -> the programs that show it is installed
declare -A PROGRAMS=(
	[tmux]="tmux"
	[util-linux]="setpriv nsenter unshare ipcrm"
	[nftables]="nft"
	[redis-server]="redis-server"
	[vim]="vim"
	[less]="less"
	[procps]="top"
	[gdb]="gdb"
	[mpich]="mpiexec"
	[libmpich-dev]="mpicc"
	[iverilog]="iverilog vvp"
	[iproute2]="ip ss"
)
ORDER=(tmux util-linux nftables redis-server vim less procps gdb mpich libmpich-dev iverilog iproute2)

# a program on PATH (or in /usr/sbin, /sbin) that can be run
have() {
	local path
	path=$(PATH="$PATH:/usr/sbin:/sbin" type -P "$1") && [[ -f $path && -x $path ]]
}

cc_works() {
	have gcc &&
		printf '#include <stdio.h>\nint main(void){return 0;}\n' |
		gcc -x c -o /dev/null - >/dev/null 2>&1
}

cc32_works() {
	have gcc &&
		printf '#include <stdio.h>\nint main(void){return 0;}\n' |
		gcc -m32 -x c -o /dev/null - >/dev/null 2>&1
}

wanted=()
cc_works || wanted+=(gcc libc6-dev)
cc32_works || wanted+=(gcc-multilib)
for pkg in "${ORDER[@]}"; do
	for prog in ${PROGRAMS[$pkg]}; do
		if ! have "$prog"; then
			wanted+=("$pkg")
			break
		fi
	done
done

if ((${#wanted[@]})); then
	say "installing ${wanted[*]}"
	if [[ $(id -u) -ne 0 ]]; then
		echo "$0: installing packages needs root" >&2
		exit 1
	fi
	export DEBIAN_FRONTEND=noninteractive
	# Refresh the package lists only when apt does not know a wanted package yet.
	for pkg in "${wanted[@]}"; do
		if ! apt-cache show "$pkg" >/dev/null 2>&1; then
			say "apt-get update"
			apt-get update
			break
		fi
	done
	apt-get install -y --no-install-recommends "${wanted[@]}"
	if ! cc_works; then
		echo "$0: gcc still cannot compile a C program" >&2
		exit 1
	fi
	cc32_works || { echo "$0: gcc -m32 still cannot compile a 32-bit program" >&2; exit 1; }
	for pkg in "${ORDER[@]}"; do
		for prog in ${PROGRAMS[$pkg]}; do
			have "$prog" || { echo "$0: $prog still missing after installing $pkg" >&2; exit 1; }
		done
	done
else
	say "all test packages present"
fi

say "$(gcc --version | head -n1); $(tmux -V); $(PATH="$PATH:/usr/sbin" nft --version);" \
	"$(redis-server --version | cut -d' ' -f1-3); $(vim --version | head -n1); $(gdb --version | head -n1);" \
	"$(mpichversion 2>/dev/null | head -n1 | tr -s ' \t' ' '); $(iverilog -V 2>&1 | head -n1)"

# A Debian install starts the packaged redis service: the tests start their own.
if command -v systemctl >/dev/null 2>&1; then
	systemctl stop redis-server >/dev/null 2>&1 || true
fi
