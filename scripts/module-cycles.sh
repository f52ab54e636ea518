#!/usr/bin/env bash
# No module cycle inside a crate (docs/architecture.md, "Layers"): each file is a module, and
# each path it names through `crate::` or `super::`, and each `use` of `self::` or of one of
# its own child modules (`pub use cluster::Cluster;`: a facade's arrow), is an arrow to the
# file that path lands in. Comments, string literals, `#[cfg(test)]` items and `tests.rs` files
# are not read (a doc link or a test may look anywhere). A bare path in code through one of the
# file's own child modules (`pages::queues(..)` beside `mod pages;`) is an arrow. A cycle is most often a parent that is both facade and shared kernel:
# give the shared part its own file. MODULE_CYCLES_TRACE=1 prints every arrow.
#
#   scripts/module-cycles.sh [ROOT]   (ROOT: a checkout, default this one)
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

# The crates whose modules form no cycle: one source root a line (its `bin/` is not read).
crates=(
  crates/dlq-core/src
  crates/dlq-client/src
  crates/kubectl-dlq/src
  crates/dlq-testenv/src
  src
)

fail=0
for root in "${crates[@]}"; do
  if [ ! -d "$root" ]; then echo "module-cycles: no crate at $root" >&2; fail=1; continue; fi
  perl - "$root" <<'PERL' || fail=1
use strict;
use warnings;
use File::Find;

my $root = shift;
my (%file_of, %arrows);
# Module path ("" for the crate root, "a::b") of each file.
find({ no_chdir => 1, wanted => sub {
  return unless /\.rs$/;
  my $rel = substr($File::Find::name, length($root) + 1);
  return if $rel =~ m{(^|/)tests(\.rs|/)} || $rel =~ m{^bin/};
  my $m = $rel;
  $m =~ s{\.rs$}{};
  $m =~ s{(^|/)(mod|lib|main)$}{};
  $m =~ s{/}{::}g;
  $file_of{$m} = $rel;
} }, $root);

# The longest prefix of a module path that is a file.
sub file_module {
  my @p = @_;
  while (@p) { my $m = join('::', @p); return $m if exists $file_of{$m}; pop @p; }
  return '';
}

# A use tree (`a::{b, c::{d}}`) as full paths.
sub expand {
  my ($tree) = @_;
  $tree =~ s/\s+as\s+\w+//g;
  $tree =~ s/\s+//g;
  if ($tree =~ /^(.*?)::\{(.*)\}$/s || $tree =~ /^()\{(.*)\}$/s) {
    my ($prefix, $inner) = ($1, $2);
    my @items;
    my ($depth, $cur) = (0, '');
    for my $ch (split //, $inner) {
      $depth++ if $ch eq '{';
      $depth-- if $ch eq '}';
      if ($ch eq ',' && $depth == 0) { push @items, $cur; $cur = ''; next; }
      $cur .= $ch;
    }
    push @items, $cur if $cur ne '';
    return map { my $e = $_; $e eq 'self' ? $prefix : ($prefix eq '' ? $e : "$prefix\::$e") }
           map { expand($_) } @items;
  }
  return ($tree);
}

for my $mod (sort keys %file_of) {
  my $path = "$root/$file_of{$mod}";
  open(my $fh, '<', $path) or die "module-cycles: $path: $!\n";
  my $src = do { local $/; <$fh> };
  # Comments and literals out (a `{` in a string must not count), then `#[cfg(test)]` items.
  $src =~ s{(//[^\n]*|/\*.*?\*/|r(#*)".*?"\2|"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])')}
           { substr($1, 0, 1) eq '/' ? ' ' : '""' }gse;
  while ($src =~ /#\[cfg\(test\)\]/g) {
    my $start = $-[0];
    my $i = $+[0];
    $i++ while $i < length($src) && substr($src, $i, 1) !~ /[;{]/;
    if ($i < length($src) && substr($src, $i, 1) eq '{') {
      my $depth = 0;
      for (; $i < length($src); $i++) {
        my $ch = substr($src, $i, 1);
        $depth++ if $ch eq '{';
        last if $ch eq '}' && --$depth == 0;
      }
    }
    substr($src, $start, $i + 1 - $start) = ' ';
    pos($src) = $start;
  }
  my @here = $mod eq '' ? () : split /::/, $mod;
  # Inline modules: where each opens and closes, to know what `super::` means at a point.
  my (@inline, @stack, $depth);
  $depth = 0;
  while ($src =~ /(\bmod\s+(\w+)\s*\{)|([{}])/g) {
    if (defined $1) { push @stack, [$2, $depth, $-[0]]; $depth++; next; }
    if ($3 eq '{') { $depth++; next; }
    $depth--;
    if (@stack && $stack[-1][1] == $depth) { my $s = pop @stack; push @inline, [$s->[2], pos($src)]; }
  }
  my $nesting = sub { my $at = shift; scalar grep { $_->[0] < $at && $at < $_->[1] } @inline };
  # A `use` may also start at a child module (`pub use cluster::Cluster;`): a facade's arrow.
  my %children = map { $_ => 1 } ($src =~ /\bmod\s+(\w+)\s*;/g);
  my @paths;
  while ($src =~ /\buse\s+([^;]+);/g) {
    my $at = $-[0];
    push @paths, map { [/^(\w+)::/ && $children{$1} ? "self::$_" : $_, $at] } expand($1);
  }
  while ($src =~ /(?<![\w\$:])((?:crate|super)(?:::\w+)+)/g) {
    push @paths, [$1, $-[0]];
  }
  # A bare path through one of its own child modules (`pages::queues(..)`) is an arrow too.
  while ($src =~ /(?<![\w\$:])((\w+)(?:::\w+)+)/g) {
    push @paths, ["self::$1", $-[0]] if $children{$2};
  }
  for my $p (@paths) {
    my ($text, $at) = @$p;
    my @seg = split /::/, $text;
    next unless @seg;
    my @to;
    if ($seg[0] eq 'crate') { shift @seg; @to = (); }
    elsif ($seg[0] eq 'super' || $seg[0] eq 'self') {
      my $up = 0;
      shift @seg if $seg[0] eq 'self';
      while (@seg && $seg[0] eq 'super') { shift @seg; $up++; }
      $up -= $nesting->($at);
      next if $up < 0 || ($up == 0 && !@seg);
      @to = @here;
      splice(@to, -$up) if $up > 0;
    }
    else { next; }
    my $target = file_module(@to, @seg);
    next if $target eq $mod;
    $arrows{$mod}{$target} = 1;
    print STDERR "module-cycles: $file_of{$mod}: $text\n" if $ENV{MODULE_CYCLES_TRACE};
  }
}

# Strongly connected components (Tarjan): any with more than one module is a cycle.
my ($index, %idx, %low, %on, @st, @cycles) = (0);
sub visit {
  my $v = shift;
  $idx{$v} = $low{$v} = $index++;
  push @st, $v; $on{$v} = 1;
  for my $w (sort keys %{ $arrows{$v} || {} }) {
    if (!exists $idx{$w}) { visit($w); $low{$v} = $low{$w} if $low{$w} < $low{$v}; }
    elsif ($on{$w} && $idx{$w} < $low{$v}) { $low{$v} = $idx{$w}; }
  }
  if ($low{$v} == $idx{$v}) {
    my @scc;
    while (1) { my $w = pop @st; $on{$w} = 0; push @scc, $w; last if $w eq $v; }
    push @cycles, [sort @scc] if @scc > 1;
  }
}
for my $v (sort keys %file_of) { visit($v) unless exists $idx{$v}; }
my $name = sub { $_[0] eq '' ? 'crate' : $_[0] };
for my $c (@cycles) {
  my %in = map { $_ => 1 } @$c;
  my @why;
  for my $v (@$c) { push @why, map { $name->($v) . ' -> ' . $name->($_) } grep { $in{$_} } sort keys %{ $arrows{$v} }; }
  print STDERR "module-cycles: $root: a cycle among " . join(', ', map { $name->($_) } @$c)
    . " (" . join('; ', @why) . ")\n";
}
exit(@cycles ? 1 : 0);
PERL
done
[ $fail = 0 ] && echo "module-cycles: no module cycle in ${crates[*]}"
exit $fail
