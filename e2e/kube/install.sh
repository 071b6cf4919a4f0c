#!/usr/bin/env bash
# Builds, from the Go module proxy, the Kubernetes tools the e2e suites need
# and caches them OUTSIDE the repo, keyed by version; a tool is rebuilt only
# when its cached copy is missing or incomplete.
#
#   e2e/kube/install.sh [--quiet] [--path] [--prune] [TOOL...]
#
# TOOL is any of: kubernetes etcd kwok helm (default: all of them).
#   kubernetes  kube-apiserver, kube-controller-manager, kube-scheduler,
#               kubectl  (k8s.io/kubernetes, through a wrapper module)
#   etcd        etcd-<ver> (go.etcd.io/etcd/server/v3, wrapper module; the
#               distinct name never shadows Debian's etcd 3.4)
#   kwok        kwok, plus its stage YAMLs in <cache>/kwok-<ver>/stage/
#   helm        helm (lint/template assume the k8s of helm's own client-go)
# --path   print only the bin directories, ':'-joined, for PATH
# --quiet  print nothing on a full cache hit
# --prune  afterwards delete the Go build and module caches under the cache
#          dir (~6.7 GB; the binaries, ~500 MB, stay)
#
# Layout: ${KVFABRIC_TOOLS_CACHE:-$HOME/.cache/kvfabric/tools}/
#   kubernetes-1.37.2/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,kubectl}
#   etcd-3.6.16/bin/etcd-3.6.16     kwok-0.8.0/bin/kwok  kwok-0.8.0/stage/...
#   helm-3.22.0/bin/helm            go/ (GOPATH, GOMODCACHE)  go-build/ (GOCACHE)
#   src/<tool>-<ver>/ (the wrapper modules)
# Versions: KVFABRIC_K8S_VERSION (1.37.2), KVFABRIC_ETCD_VERSION (3.6.16),
# KVFABRIC_KWOK_VERSION (0.8.0), KVFABRIC_HELM_VERSION (3.22.0).
# KVFABRIC_GO_BUILD_P sets `go build -p` (default: Go's, = cores); use 1 when
# memory is tight (kube-apiserver links at ~2.4 GB RSS).
# Builds run one at a time; a lock file serialises concurrent installs.
set -euo pipefail

K8S_VERSION="${KVFABRIC_K8S_VERSION:-1.37.2}"
ETCD_VERSION="${KVFABRIC_ETCD_VERSION:-3.6.16}"
KWOK_VERSION="${KVFABRIC_KWOK_VERSION:-0.8.0}"
HELM_VERSION="${KVFABRIC_HELM_VERSION:-3.22.0}"
CACHE="${KVFABRIC_TOOLS_CACHE:-$HOME/.cache/kvfabric/tools}"

quiet=0
prune=0
print_path=0
tools=()
for a in "$@"; do
  case "$a" in
    --quiet) quiet=1 ;;
    --path) print_path=1; quiet=1 ;;
    --prune) prune=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    kubernetes|etcd|kwok|helm) tools+=("$a") ;;
    *) echo "install.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
  esac
done
[ "${#tools[@]}" -gt 0 ] || tools=(kubernetes etcd kwok helm)

say() { [ "$quiet" = 1 ] || echo "install.sh: $*" >&2; }
die() { echo "install.sh: error: $*" >&2; exit 1; }

# --- where each tool lives, and what makes its cache entry complete ----------
tool_dir() {
  case "$1" in
    kubernetes) echo "$CACHE/kubernetes-$K8S_VERSION" ;;
    etcd) echo "$CACHE/etcd-$ETCD_VERSION" ;;
    kwok) echo "$CACHE/kwok-$KWOK_VERSION" ;;
    helm) echo "$CACHE/helm-$HELM_VERSION" ;;
  esac
}
tool_files() {
  case "$1" in
    kubernetes) echo bin/kube-apiserver bin/kube-controller-manager bin/kube-scheduler bin/kubectl ;;
    etcd) echo "bin/etcd-$ETCD_VERSION" ;;
    kwok) echo bin/kwok stage/node/fast/node-initialize.yaml ;;
    helm) echo bin/helm ;;
  esac
}
# Complete = the stamp written after the last file landed, and every file.
cached() {
  local d f
  d="$(tool_dir "$1")"
  [ -f "$d/.complete" ] || return 1
  for f in $(tool_files "$1"); do [ -s "$d/$f" ] || return 1; done
  for f in "$d"/bin/*; do [ -x "$f" ] || return 1; done
}

if [ "$print_path" = 1 ]; then
  p=""
  for t in "${tools[@]}"; do
    cached "$t" || die "$t is not installed; run e2e/kube/install.sh $t"
    p="${p:+$p:}$(tool_dir "$t")/bin"
  done
  echo "$p"
  exit 0
fi

# --- fast path: everything cached, no Go needed ------------------------------
missing=()
for t in "${tools[@]}"; do cached "$t" || missing+=("$t"); done
prune_go() {
  [ "$prune" = 1 ] || return 0
  chmod -R u+w "$CACHE/go" 2>/dev/null || true
  rm -rf "$CACHE/go" "$CACHE/go-build"
  say "pruned the Go caches in $CACHE"
}
if [ "${#missing[@]}" -eq 0 ]; then
  for t in "${tools[@]}"; do say "$t: cached in $(tool_dir "$t")"; done
  prune_go
  exit 0
fi

command -v go >/dev/null 2>&1 || die "'go' is not on PATH (needed to build ${missing[*]}; Go >= 1.25)"
mkdir -p "$CACHE/src" "$CACHE/go" "$CACHE/go-build"
export GOPATH="$CACHE/go" GOMODCACHE="$CACHE/go/pkg/mod" GOCACHE="$CACHE/go-build"
export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false -modcacherw -trimpath"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
pflag=()
[ -z "${KVFABRIC_GO_BUILD_P:-}" ] || pflag=(-p "$KVFABRIC_GO_BUILD_P")

# One install at a time (two test suites starting together must not build
# the same thing twice into the same place).
exec 9>"$CACHE/.install.lock"
if ! flock -n 9; then
  say "another install.sh holds $CACHE/.install.lock; waiting (up to 60 min)"
  flock -w 3600 9 || die "timed out waiting for $CACHE/.install.lock"
fi

now() { date +%s; }
built=()
# stage DIR: build into a temporary sibling, then move into place whole, so
# an interrupted build never looks complete.
begin() { local d; d="$(tool_dir "$1")"; rm -rf "$d.tmp" "$d"; mkdir -p "$d.tmp/bin"; echo "$d.tmp"; }
finish() {
  local d; d="$(tool_dir "$1")"
  date -u +%FT%TZ >"$d.tmp/.complete"
  mv "$d.tmp" "$d"
  cached "$1" || die "$1: built, but $d is incomplete"
}

# Module directory of MOD@VER in the module cache (downloads it).
moddir() { go mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'; }

build_kubernetes() {
  local out src kdir staging m minor bt t n
  out="$(begin kubernetes)"
  src="$CACHE/src/kubernetes-$K8S_VERSION"
  minor="${K8S_VERSION#*.}"; minor="${minor%%.*}"
  staging="v0.${K8S_VERSION#*.}"
  mkdir -p "$src"
  say "kubernetes $K8S_VERSION: fetching k8s.io/kubernetes@v$K8S_VERSION"
  kdir="$(moddir k8s.io/kubernetes "v$K8S_VERSION")"
  [ -f "$kdir/go.mod" ] || die "could not download k8s.io/kubernetes@v$K8S_VERSION"
  # kubernetes' go.mod requires its staging modules at v0.0.0 and replaces
  # them with ./staging/...; `go install pkg@ver` refuses that, so a wrapper
  # module replaces every required k8s.io/* v0.0.0 with its published v0.X.Y.
  {
    echo "module kvfabric.local/kube-tools"
    echo
    echo "go $(sed -n 's/^go \([0-9.]*\).*/\1/p' "$kdir/go.mod")"
    echo
    echo "require k8s.io/kubernetes v$K8S_VERSION"
    echo
    echo "tool ("
    for t in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      echo "	k8s.io/kubernetes/cmd/$t"
    done
    echo ")"
    echo
    awk '/^require[[:space:]]*\(/{r=1;next} r&&/^\)/{r=0} r&&$1 ~ /^k8s\.io\// && $2=="v0.0.0"{print $1}' "$kdir/go.mod" |
      sort -u | while read -r m; do echo "replace $m => $m $staging"; done
  } >"$src/go.mod"
  n="$(grep -c '^replace' "$src/go.mod")"
  [ "$n" -gt 10 ] || die "found only $n staging modules in k8s.io/kubernetes' go.mod"
  say "kubernetes $K8S_VERSION: wrapper module with $n staging replaces; go mod tidy"
  (cd "$src" && go mod tidy) || die "go mod tidy failed in $src"
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=${K8S_VERSION%%.*}"
    ld="$ld -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    ld="$ld -X $pkg.buildDate=$(date -u +%FT%TZ)"
  done
  for t in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    bt="$(now)"
    say "kubernetes $K8S_VERSION: go build $t"
    (cd "$src" && go build "${pflag[@]}" -ldflags "$ld" -o "$out/bin/$t" "k8s.io/kubernetes/cmd/$t") ||
      die "go build $t failed"
    say "kubernetes $K8S_VERSION: $t built in $(( $(now) - bt )) s"
  done
  finish kubernetes
}

build_etcd() {
  local out src edir
  out="$(begin etcd)"
  src="$CACHE/src/etcd-$ETCD_VERSION"
  mkdir -p "$src"
  say "etcd $ETCD_VERSION: fetching go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  edir="$(moddir go.etcd.io/etcd/server/v3 "v$ETCD_VERSION")"
  [ -f "$edir/main.go" ] || die "go.etcd.io/etcd/server/v3@v$ETCD_VERSION has no main package"
  # etcd's server module replaces its sibling modules with ../api etc.; as a
  # dependency of a wrapper module those replaces are ignored and its
  # requires (the same release) are used.
  cat >"$src/go.mod" <<EOF
module kvfabric.local/etcd-tools

go $(sed -n 's/^go \([0-9.]*\).*/\1/p' "$edir/go.mod")

require go.etcd.io/etcd/server/v3 v$ETCD_VERSION

tool go.etcd.io/etcd/server/v3
EOF
  (cd "$src" && go mod tidy) || die "go mod tidy failed in $src"
  (cd "$src" && go build "${pflag[@]}" -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=v$ETCD_VERSION" -o "$out/bin/etcd-$ETCD_VERSION" go.etcd.io/etcd/server/v3) ||
    die "go build etcd failed"
  finish etcd
}

build_kwok() {
  local out kdir
  out="$(begin kwok)"
  say "kwok $KWOK_VERSION: go install sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
  GOBIN="$out/bin" go install "${pflag[@]}" -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION" || die "go install kwok failed"
  kdir="$(moddir sigs.k8s.io/kwok "v$KWOK_VERSION")"
  [ -d "$kdir/kustomize/stage" ] || die "sigs.k8s.io/kwok@v$KWOK_VERSION has no kustomize/stage/"
  cp -r "$kdir/kustomize/stage" "$out/stage"
  chmod -R u+w "$out/stage"
  finish kwok
}

build_helm() {
  local out hdir cg maj min
  out="$(begin helm)"
  hdir="$(moddir helm.sh/helm/v3 "v$HELM_VERSION")"
  [ -f "$hdir/go.mod" ] || die "could not download helm.sh/helm/v3@v$HELM_VERSION"
  # As helm's Makefile does: the default Capabilities.KubeVersion (used by
  # lint and template) follows the client-go helm was built with; without
  # these ldflags it is v1.20.
  cg="$(awk '$1=="k8s.io/client-go"{print $2; exit}' "$hdir/go.mod")"
  cg="${cg#v}"
  maj=$(( ${cg%%.*} + 1 )); min="${cg#*.}"; min="${min%%.*}"
  say "helm $HELM_VERSION: go install (client-go v$cg: k8s default $maj.$min)"
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  local p
  for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ld="$ld -X $p.k8sVersionMajor=$maj -X $p.k8sVersionMinor=$min"
  done
  GOBIN="$out/bin" go install "${pflag[@]}" -ldflags "$ld" "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION" ||
    die "go install helm failed"
  finish helm
}

total0="$(now)"
for t in "${tools[@]}"; do
  if cached "$t"; then
    say "$t: cached in $(tool_dir "$t")"
    continue
  fi
  t0="$(now)"
  say "$t: not cached; building (one go build at a time)"
  "build_$t"
  built+=("$t ($(( $(now) - t0 )) s)")
  say "$t: built in $(( $(now) - t0 )) s -> $(tool_dir "$t")"
done
say "built: ${built[*]:-nothing}; total $(( $(now) - total0 )) s"
prune_go
say "PATH addition: $("$0" --path "${tools[@]}")"
