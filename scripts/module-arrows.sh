#!/usr/bin/env bash
# The operator crate's module arrows run one way (docs/architecture.md, "Layers"): a module
# names only modules of a lower layer, never one beside it or above it. Comments and test
# modules (`tests.rs`, a `tests/` directory) are not read (a doc link or a test may look anywhere). Six more rules:
# - a backend's source never names `crate::targets`, and a target never names `crate::source`:
#   what both need of a broker (connection, codec, classification) is `crate::broker::<name>`
#   (the supervisor, src/source/mod.rs, closes the targets of deleted queues through a closure
#   crate::run passes in);
# - seal-or-open is decided in src/body/payload.rs: outside src/body/ no file names the seal's
#   open (`dlq_core::seal::open`, `open_job`, `body_reader`) or a store's sealed put or read
#   (`put_sealed`, `fetch_opened`, `seal_body`, `BodySealer`);
# - a source asks the core once per dead message: no file of src/source/ calls the steps
#   `dlq_core::source_plan::plan` takes together (`dispose`, `dispose_kept`, `after_refusal`,
#   `arriving`, `placement`, `request_size`);
# - a source or a target never reads a Secret itself (`read_secret`, `SecretReads::value`): a
#   backend's connection is read from the queue's spec and Secrets by `crate::broker::<name>`
#   (which backend a spec names: `crate::broker::backend`);
# - no cycle between the files of src/: each file is a module, and every `crate::`, `super::`
#   and `self::` path it names, and every path a `mod.rs` names through one of its own child
#   modules (`pub use context::Context`), is an arrow to the file it lands in. A parent
#   `mod.rs` that is both facade and shared kernel makes one; give the shared part its own file.
#
#   scripts/module-arrows.sh [ROOT]   (ROOT: a checkout, default this one)
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

# Layer of each top-level module of src/ (higher uses lower).
declare -A layer=(
  [run]=6
  [reconcile]=5 [source]=5 [alert]=5 [reveal]=5
  [pass]=4
  [state]=3 [targets]=3 [server]=3 [keys]=3 [body]=3
  [broker]=2
  [metrics]=1 [access]=1 [secret]=1 [https]=1 [serving_tls]=1 [failpoint]=1
)

# The seal and open primitives only src/body/ names (what `body::payload` decides between).
seal_or_open='seal::(open|open_job|seal_body|body_reader|BodySealer)\b|\b(open_job|fetch_opened|put_sealed|seal_body|body_reader|BodySealer)\b'

# The steps of a source's park plan (dlq_core::source_plan decides them all at once); a
# plan's own methods (`parking.after_refusal(..)`) are what a source calls instead.
park_steps='(^|[^.A-Za-z0-9_])(dispose|dispose_kept|after_refusal|arriving|placement|request_size)\b'

# The code of a file without comments and without its trailing `#[cfg(test)] mod ...`.
code_of() {
  awk '/^#\[cfg\(test\)\]/ { test = 1; next }
       test && /^(pub(\(crate\))? )?mod / { exit }
       { test = 0; sub(/\/\/.*/, ""); print }' "$1"
}

fail=0
for dir in src/*/ src/*.rs; do
  name=$(basename "$dir" .rs)
  case $name in lib|main) continue ;; esac
  if [ -z "${layer[$name]:-}" ]; then
    echo "module-arrows: src/$name has no layer: add it to scripts/module-arrows.sh and docs/architecture.md" >&2
    fail=1; continue
  fi
  while IFS= read -r file; do
    case $file in */tests.rs|*/tests/*) continue ;; esac
    for used in $(code_of "$file" | grep -oE 'crate::[a-z_]+' | sed 's/crate:://' | sort -u); do
      [ "$used" = "$name" ] && continue
      if [ -z "${layer[$used]:-}" ]; then
        echo "module-arrows: $file names crate::$used, which has no layer" >&2; fail=1
      elif [ "${layer[$used]}" -ge "${layer[$name]}" ]; then
        echo "module-arrows: $file ($name, layer ${layer[$name]}) names crate::$used (layer ${layer[$used]}): arrows run down only" >&2
        fail=1
      fi
    done
  done < <(find "${dir%/}" -name '*.rs' | sort)
done
# A backend's source and its target meet only in crate::broker.
while IFS= read -r file; do
  case $file in */tests.rs|*/tests/*) continue ;; esac
  case $file in
    src/source/*) other=targets ;;
    src/targets/*) other=source ;;
  esac
  # Not grep -q: an early exit would SIGPIPE awk, and pipefail would then read the match as
  # none (the probe in deps-check caught it one run in three).
  if code_of "$file" | grep -E "crate::$other\b" >/dev/null; then
    echo "module-arrows: $file names crate::$other: a source and a target share a broker through crate::broker, never each other" >&2
    fail=1
  fi
done < <(find src/source src/targets -name '*.rs' | sort)

# Seal-or-open is decided in one room: outside src/body/ (the store's primitives, and
# body/payload.rs, which decides), no file names the seal's open or the store's sealed put.
while IFS= read -r file; do
  case $file in */tests.rs|*/tests/*|src/body/*) continue ;; esac
  if code_of "$file" | grep -E "$seal_or_open" >/dev/null; then
    echo "module-arrows: $file names a seal or open primitive: seal-or-open is src/body/payload.rs's (crate::body::payload)" >&2
    fail=1
  fi
done < <(find src -name '*.rs' | sort)

# A source asks the core once per dead message (dlq_core::source_plan::plan) and carries the
# plan out: no file of src/source/ calls the plan's steps itself.
while IFS= read -r file; do
  case $file in */tests.rs|*/tests/*) continue ;; esac
  if code_of "$file" | grep -E "$park_steps" >/dev/null; then
    echo "module-arrows: $file calls a step of a source's park plan itself: one decision per park, dlq_core::source_plan::plan" >&2
    fail=1
  fi
done < <(find src/source -name '*.rs' | sort)

# A backend's Secrets are read in one place, its crate::broker module (the HTTP target, which has
# none, in src/targets/http.rs): a source or a target never reads one itself.
while IFS= read -r file; do
  case $file in */tests.rs|*/tests/*|src/targets/http.rs) continue ;; esac
  if code_of "$file" | grep -E '\bread_secret\b|\b(reads|secrets)\.value\(' >/dev/null; then
    echo "module-arrows: $file reads a Secret itself: a backend's connection and Secrets are read by its crate::broker module (source, target and backlog probe alike)" >&2
    fail=1
  fi
done < <(find src/source src/targets -name '*.rs' | sort)

# No cycle between the files of src/ (super:: arrows included).
perl - <<'PERL' || fail=1
use strict;
use warnings;
my (%file_of, %arrows);
my @files = split /\n/, `find src -name '*.rs' | sort`;
for my $f (@files) {
  next if $f =~ m{(^|/)(tests|lib|main)\.rs$|/tests/};
  (my $m = $f) =~ s{^src/}{};
  $m =~ s{/mod\.rs$}{}; $m =~ s{\.rs$}{}; $m =~ s{/}{::}g;
  $file_of{$m} = $f;
}
# `prefix::{a, b::c as d, self}` as `prefix::a prefix::b::c prefix`.
sub expand {
  my ($prefix, $list) = @_;
  my @out;
  for my $x (split /,/, $list) {
    $x =~ s/^\s+|\s+$//g; $x =~ s/\s+as\s+\w+$//;
    next if $x eq '';
    push @out, $x eq 'self' ? $prefix : "${prefix}::$x";
  }
  return join ' ', @out;
}
# The longest module that `path` (segments) starts with, or undef.
sub land { my @seg = @_; while (@seg) { my $m = join '::', @seg; return $m if exists $file_of{$m}; pop @seg; } return undef; }
for my $m (sort keys %file_of) {
  my $f = $file_of{$m};
  open my $fh, '<', $f or die "$f: $!";
  my ($code, $test) = ('', 0);
  while (my $l = <$fh>) {
    if ($l =~ /^#\[cfg\(test\)\]/) { $test = 1; next }
    last if $test && $l =~ /^(pub(\(crate\))? )?mod /;
    $test = 0; $l =~ s{//.*}{}; $code .= $l;
  }
  close $fh;
  my $is_dir = $f =~ m{/mod\.rs$};
  my @self = split /::/, $m;
  my @parent = $is_dir ? @self : @self[0 .. $#self - 1];
  my %children = map { $_ => 1 } ($code =~ /^\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_0-9]+)\s*;/mg);
  my @to;
  # Braced groups expand to one path each: `use super::{a, b::c}` -> super::a, super::b::c.
  1 while $code =~ s{((?:crate|super|self|[a-z_0-9]+)(?:::[a-z_0-9]+)*)::\{([^{}]*)\}}{expand($1, $2)}ge;
  while ($code =~ /(?<![A-Za-z0-9_:])((?:crate|super|self|[a-z_][a-z_0-9]*)(?:::[A-Za-z_][A-Za-z_0-9]*)+)/g) {
    my @seg = split /::/, $1;
    my @base;
    if ($seg[0] eq 'crate') { shift @seg; @base = () }
    elsif ($seg[0] eq 'super') { shift @seg; @base = @parent; while (@seg && $seg[0] eq 'super') { shift @seg; pop @base } }
    elsif ($seg[0] eq 'self') { shift @seg; @base = $is_dir ? @self : @parent }
    elsif ($children{$seg[0]}) { @base = @self }
    else { next }
    # The deepest module the path lands in; a path to an item of `base` lands in `base`.
    my $t = land(@base, @seg) // (@base ? land(@base) : undef);
    push @to, $t if defined $t && $t ne $m;
  }
  my %seen; $arrows{$m} = [grep { !$seen{$_}++ } @to];
}
# Tarjan's strongly connected components.
my ($index, @stack, %idx, %low, %on, @cycles) = (0);
sub visit {
  my $v = shift; $idx{$v} = $low{$v} = $index++; push @stack, $v; $on{$v} = 1;
  for my $w (@{ $arrows{$v} || [] }) {
    if (!exists $idx{$w}) { visit($w); $low{$v} = $low{$w} if $low{$w} < $low{$v} }
    elsif ($on{$w}) { $low{$v} = $idx{$w} if $idx{$w} < $low{$v} }
  }
  if ($low{$v} == $idx{$v}) {
    my @c; my $w; do { $w = pop @stack; $on{$w} = 0; push @c, $w } while ($w ne $v);
    push @cycles, [sort @c] if @c > 1;
  }
}
visit($_) for grep { !exists $idx{$_} } sort keys %file_of;
for my $c (@cycles) {
  my %in = map { $_ => 1 } @$c;
  my @edges = map { my $a = $_; map { "$file_of{$a} -> $file_of{$_}" } grep { $in{$_} } @{ $arrows{$a} } } @$c;
  print STDERR "module-arrows: a cycle between the files of src/: ", join('; ', @edges), "\n";
}
exit(@cycles ? 1 : 0);
PERL

# src/lib.rs tells the same layers: its `//! N. ...` lines name exactly the modules of layer N.
declare -A told=()
n=0
while IFS= read -r line; do
  if [[ $line =~ ^//!\ ([0-9])\.\  ]]; then n=${BASH_REMATCH[1]}; fi
  [[ $line == '//!'* ]] || { n=0; continue; }
  [ "$n" = 0 ] && continue
  for m in $(grep -oE '\[`[a-z_]+`\]' <<<"$line" | tr -d '[]`'); do told[$m]=$n; done
done < src/lib.rs
for m in "${!layer[@]}"; do
  if [ "${told[$m]:-}" != "${layer[$m]}" ]; then
    echo "module-arrows: src/lib.rs puts $m in layer ${told[$m]:-none}; this table says ${layer[$m]}" >&2; fail=1
  fi
done
for m in "${!told[@]}"; do
  [ -n "${layer[$m]:-}" ] || { echo "module-arrows: src/lib.rs names $m in layer ${told[$m]}; this table has no such module" >&2; fail=1; }
done

[ $fail = 0 ] && echo "module-arrows: every arrow in src/ runs down (run > reconcile, source, alert, reveal > pass > state, targets, server, keys, body > broker > metrics, access, secret, https, serving_tls, failpoint); no source names a target nor a target a source; seal-or-open only in src/body/; one park plan per dead message; no source or target reads a Secret itself; no cycle between the files of src/; src/lib.rs tells the same layers"
exit $fail
