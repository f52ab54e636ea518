#!/usr/bin/env bash
# Checks the project's Markdown links without a build or the network:
#  - every relative link ([text](path), ![alt](path), [ref]: path) in README.md, CHANGELOG.md
#    (when present), docs/*.md and charts/**/*.md names a file or directory that exists;
#  - every #anchor (in the same file or another Markdown file) is an ATX heading (# ...) there
#    under GitHub's rules (lower case; punctuation other than - and _ dropped; each space to -;
#    -1, -2, ... for repeated headings) or an explicit <a id="..."> / <a name="...">;
#  - external http(s) links are well formed (not fetched); links to this repository's own files
#    on GitHub (<repo>/blob/<ref>/<path>#anchor) are checked like relative ones;
#  - the chart's runbook URLs: every runbookBaseUrl in charts/*/values.yaml ends in
#    docs/runbooks.md, every alert the chart renders and every per-record alert the operator
#    raises has a section `Alert: <name>` in docs/runbooks.md, and every literal runbook_url under
#    charts/ (the promtool tests) is <base>#<an anchor of docs/runbooks.md>;
#  - the CRDs the docs name agree with crds/dlq.dev.yaml: "the <number> CRDs" counts them, and
#    every `kubectl delete crd` (README, docs, the chart's NOTES) names each of them.
# Prints what it checked; for each broken link `file:line: why`; exits 1 if any.
#
#   scripts/docs-check.sh            (make docs-check; part of make test)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export LC_ALL=C.UTF-8

errors=0
fail() { # file line message
  echo "$1:$2: $3" >&2
  errors=$((errors + 1))
}

# The repository's own address on GitHub, from the chart's `home:` (links there are checked here).
repo_url=$(sed -n 's/^home:[[:space:]]*//p' charts/*/Chart.yaml 2>/dev/null | head -1)
repo_url=${repo_url%/}

files=(README.md)
[ -f CHANGELOG.md ] && files+=(CHANGELOG.md)
for f in docs/*.md; do [ -f "$f" ] && files+=("$f"); done
while IFS= read -r f; do files+=("$f"); done < <(find charts -name '*.md' -type f 2>/dev/null | sort)

# Lines of a Markdown file outside fenced code blocks, as "<line number>\t<text>".
prose() {
  awk '
    /^[ \t]*(```|~~~)/ { fence = !fence; next }
    !fence { printf "%d\t%s\n", NR, $0 }
  ' "$1"
}

# The anchors of a Markdown file, one a line: GitHub's heading slugs (with -N for repeats) and
# explicit <a id/name> anchors.
slugs() {
  prose "$1" | cut -f2- | grep -E '^#{1,6}[[:space:]]' |
    sed -E 's/^#+[[:space:]]+//; s/[[:space:]]+#+[[:space:]]*$//; s/[[:space:]]+$//' |
    sed -E 's/\]\([^)]*\)//g; s/<[^>]+>//g' |
    while IFS= read -r h; do printf '%s\n' "${h,,}"; done |
    sed -E $'s/-/\\x01/g; s/_/\\x02/g; s/[[:punct:]]//g; s/\\x01/-/g; s/\\x02/_/g; s/ /-/g' |
    awk '{ n = seen[$0]++; print (n ? $0 "-" n : $0) }'
  prose "$1" | cut -f2- | grep -oE '<a[[:space:]]+(id|name)="[^"]+"' | sed -E 's/.*="([^"]+)"/\1/'
}

declare -A anchors=() have_anchors=()
has_anchor() { # file anchor
  local f=$1 a
  if [ -z "${have_anchors[$f]:-}" ]; then
    have_anchors[$f]=1
    while IFS= read -r a; do anchors["$f#$a"]=1; done < <(slugs "$f")
  fi
  [ -n "${anchors["$f#$2"]:-}" ]
}

# Every link of a Markdown file as "<line>\t<target>": inline links and images (code spans
# removed first), reference definitions and <http...> autolinks.
links() {
  prose "$1" | awk -F'\t' -v q="'" '
    {
      line = $1; text = substr($0, length($1) + 2)
      gsub(/``[^`]*``/, "", text); gsub(/`[^`]*`/, "", text)
      if (text ~ /^[ ]*\[[^]]+\]:[ ]+[^ ]/) {
        t = text; sub(/^[ ]*\[[^]]+\]:[ ]+/, "", t); sub(/[ ].*$/, "", t)
        print line "\t" t
        next
      }
      rest = text
      while (match(rest, /\]\([^)]*\)/)) {
        t = substr(rest, RSTART + 2, RLENGTH - 3)
        rest = substr(rest, RSTART + RLENGTH)
        sub(/^[ ]+/, "", t); sub(/[ ]+$/, "", t)
        if (t ~ /^</) { sub(/^</, "", t); sub(/>.*$/, "", t) }
        else if (t ~ /[ ]/) {
          # A destination ends at a space only when a title follows: `(path "title")`.
          title = t; sub(/^[^ ]*[ ]+/, "", title); sub(/[ ].*$/, "", t)
          c = substr(title, 1, 1)
          if (c != "\"" && c != q && c != "(") t = t " " title
        }
        print line "\t" t
      }
      rest = text
      while (match(rest, /<https?:\/\/[^>]*>/)) {
        print line "\t" substr(rest, RSTART + 1, RLENGTH - 2)
        rest = substr(rest, RSTART + RLENGTH)
      }
    }'
}

url_re='^https?://[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]+)?([/?#][^[:space:]<>"]*)?$'

# A local target (path relative to the repository root, maybe with #anchor) seen from file:line.
check_local() { # file line path anchor what
  local file=$1 line=$2 path=$3 anchor=$4 what=$5
  if [ ! -e "$path" ]; then
    fail "$file" "$line" "$what: no such file: $path"
    return
  fi
  [ -z "$anchor" ] && return
  case $path in
    *.md)
      has_anchor "$path" "$anchor" || fail "$file" "$line" "$what: no heading or anchor #$anchor in $path" ;;
    *)
      [[ $anchor =~ ^L[0-9]+(-L[0-9]+)?$ ]] || fail "$file" "$line" "$what: #$anchor on $path, which is not Markdown" ;;
  esac
}

# A target written in `file`: the path it resolves to from the repository root.
resolve() { # file path
  local dir p
  case $2 in
    /*) p=${2#/} ;;
    *) dir=$(dirname "$1"); p=$dir/$2 ;;
  esac
  p=$(realpath -m --relative-to=. "$p")
  printf '%s' "$p"
}

# An http(s) URL: well formed; if it points into this repository, checked locally too.
check_url() { # file line url what
  local file=$1 line=$2 url=$3 what=$4 rest path anchor
  if ! [[ $url =~ $url_re ]]; then
    fail "$file" "$line" "$what: malformed URL: $url"
    return 1
  fi
  if [ -n "$repo_url" ] && [[ $url == "$repo_url"/blob/* || $url == "$repo_url"/tree/* ]]; then
    rest=${url#"$repo_url"/*/}   # <ref>/<path>[#anchor]
    rest=${rest#*/}              # <path>[#anchor]
    path=${rest%%#*}; path=${path%%\?*}
    anchor=; [[ $rest == *#* ]] && anchor=${rest#*#}
    check_local "$file" "$line" "$path" "$anchor" "$what"
    repo_links=$((repo_links + 1))
  fi
  return 0
}

total=0 rel=0 rel_anchors=0 same=0 ext=0 repo_links=0
for file in "${files[@]}"; do
  n=0
  while IFS=$'\t' read -r line target; do
    n=$((n + 1))
    case $target in
      '') fail "$file" "$line" "empty link target" ;;
      *' '*) fail "$file" "$line" "a space in a link target (write %20, or <...>): $target" ;;
      http:* | https:*)
        ext=$((ext + 1))
        check_url "$file" "$line" "$target" "link" ;;
      mailto:*)
        ext=$((ext + 1))
        [[ $target =~ ^mailto:[^@[:space:]]+@[^@[:space:]]+$ ]] || fail "$file" "$line" "malformed mailto: $target" ;;
      \#*)
        same=$((same + 1))
        has_anchor "$file" "${target#\#}" || fail "$file" "$line" "no heading or anchor $target in $file" ;;
      *)
        if [[ $target =~ ^[A-Za-z][A-Za-z0-9+.-]*: ]]; then
          fail "$file" "$line" "unsupported link scheme: $target"
          continue
        fi
        rel=$((rel + 1))
        path=${target%%#*}; path=${path%%\?*}
        anchor=; [[ $target == *#* ]] && anchor=${target#*#}
        resolved=$(resolve "$file" "$path")
        [ -n "$anchor" ] && rel_anchors=$((rel_anchors + 1))
        case $resolved in
          ../* | ..) fail "$file" "$line" "link leaves the repository: $target" ;;
          *) check_local "$file" "$line" "$resolved" "$anchor" "link" ;;
        esac ;;
    esac
  done < <(links "$file")
  total=$((total + n))
  printf '  %-44s %4d links\n' "$file" "$n"
done

md_repo_links=$repo_links

# Runbook URLs of the chart.
runbooks=docs/runbooks.md
rb_urls=0 rb_alerts=0
bases=()
while IFS=: read -r vfile vline value; do
  value=$(sed -E 's/^[^:]*runbookBaseUrl:[[:space:]]*//; s/[[:space:]]+#.*$//; s/^["'\'']//; s/["'\'']$//' <<<"$value")
  [ -z "$value" ] && continue
  rb_urls=$((rb_urls + 1))
  check_url "$vfile" "$vline" "$value" "runbookBaseUrl" || continue
  if [[ $value != */docs/runbooks.md ]]; then
    fail "$vfile" "$vline" "runbookBaseUrl does not point at docs/runbooks.md: $value"
    continue
  fi
  bases+=("$value")
done < <(grep -nH 'runbookBaseUrl:' charts/*/values.yaml 2>/dev/null)
[ ${#bases[@]} -gt 0 ] || fail charts 0 "no runbookBaseUrl pointing at docs/runbooks.md in charts/*/values.yaml"
[ -f "$runbooks" ] || fail "$runbooks" 0 "missing"

# Alerts: the chart's rules (dict "alert" "Name" in templates, or literal `- alert: Name`) and the
# operator's per-record alerts (`const ...: &str = "DeadLetter..."` in its alert sources).
declare -A alert_at=()
while IFS=: read -r afile aline name; do
  name=$(sed -E 's/.*"alert"[[:space:]]+"([^"]+)".*/\1/; s/.*alert:[[:space:]]*([A-Za-z0-9_]+).*/\1/' <<<"$name")
  alert_at[$name]=$afile:$aline
done < <(grep -rnHE '"alert"[[:space:]]+"[A-Za-z0-9_]+"|^[[:space:]]*-[[:space:]]*alert:[[:space:]]*[A-Za-z0-9_]+[[:space:]]*$' charts/*/templates 2>/dev/null)
chart_alerts=${#alert_at[@]}
[ "$chart_alerts" -gt 0 ] || fail charts 0 "no alerting rules found in charts/*/templates"
record_alerts=0
while IFS=: read -r afile aline name; do
  name=$(sed -E 's/.*"(DeadLetter[A-Za-z0-9]+)".*/\1/' <<<"$name")
  alert_at[$name]=$afile:$aline
  record_alerts=$((record_alerts + 1))
done < <(find src crates -path '*alert*' -name '*.rs' -print0 2>/dev/null |
  xargs -0 -r grep -nHE 'const [A-Z_]+: &str = "DeadLetter[A-Za-z0-9]+";')
[ "$record_alerts" -gt 0 ] || fail src 0 "no per-record alert names (const ...: &str = \"DeadLetter...\") found in the operator's alert sources"
for name in "${!alert_at[@]}"; do
  rb_alerts=$((rb_alerts + 1))
  has_anchor "$runbooks" "alert-${name,,}" ||
    fail "${alert_at[$name]%:*}" "${alert_at[$name]##*:}" "alert $name has no runbook: no heading 'Alert: $name' (#alert-${name,,}) in $runbooks"
done

# Literal runbook_url values under charts/ (promtool's expected alerts).
while IFS=: read -r ufile uline value; do
  url=$(sed -E "s/^[^:]*runbook_url:[[:space:]]*//; s/^[\"']//; s/[\"'][[:space:]]*$//" <<<"$value")
  [[ $url == *'{{'* ]] && continue
  rb_urls=$((rb_urls + 1))
  check_url "$ufile" "$uline" "$url" "runbook_url" || continue
  ok=
  for b in "${bases[@]}"; do [[ $url == "$b#"* ]] && ok=1; done
  [ -n "$ok" ] || { fail "$ufile" "$uline" "runbook_url is not <runbookBaseUrl>#<anchor>: $url"; continue; }
  # (a URL into this repository had its anchor checked by check_url already)
  [[ -n $repo_url && $url == "$repo_url"/* ]] ||
    has_anchor "$runbooks" "${url#*#}" || fail "$ufile" "$uline" "runbook_url: no heading or anchor #${url#*#} in $runbooks"
done < <(grep -rnH 'runbook_url:' charts 2>/dev/null)

# The CRDs the docs name, against crds/dlq.dev.yaml (what the chart installs).
mapfile -t crd_names < <(awk '/^kind: CustomResourceDefinition/ { want = 1 }
  want && /^  name:/ { print $2; want = 0 }' crds/dlq.dev.yaml)
numbers=(zero one two three four five six seven eight nine ten)
crd_count_word=${numbers[${#crd_names[@]}]:-${#crd_names[@]}}
crd_mentions=0
while IFS=: read -r cfile cline text; do
  crd_mentions=$((crd_mentions + 1))
  said=$(grep -oiE 'the (zero|one|two|three|four|five|six|seven|eight|nine|ten|[0-9]+) CRDs' <<<"$text" | head -1 | awk '{ print tolower($2) }')
  [ -z "$said" ] || [ "$said" = "$crd_count_word" ] || [ "$said" = "${#crd_names[@]}" ] ||
    fail "$cfile" "$cline" "says the $said CRDs; crds/dlq.dev.yaml has ${#crd_names[@]} (${crd_names[*]})"
done < <(grep -rnHiE 'the (zero|one|two|three|four|five|six|seven|eight|nine|ten|[0-9]+) CRDs' "${files[@]}" charts/*/templates/NOTES.txt 2>/dev/null)
while IFS=: read -r cfile cline text; do
  crd_mentions=$((crd_mentions + 1))
  for c in "${crd_names[@]}"; do
    grep -qF "$c" <<<"$text" || fail "$cfile" "$cline" "kubectl delete crd leaves $c (crds/dlq.dev.yaml) behind"
  done
done < <(grep -rnHE 'kubectl delete crds? [a-z]' "${files[@]}" charts/*/templates/NOTES.txt 2>/dev/null)

echo "docs-check: ${#files[@]} Markdown files, $total links: $rel relative ($rel_anchors into another file's headings), $same same-file anchors, $ext external (well-formed only, not fetched; $md_repo_links into this repository, checked here)"
echo "docs-check: CRDs: ${#crd_names[@]} in crds/dlq.dev.yaml; $crd_mentions lines naming them agree"
echo "docs-check: runbooks: $chart_alerts chart alerts and $record_alerts per-record alerts each have a section in $runbooks; $rb_urls runbook URLs in charts/ checked"
if [ "$errors" -gt 0 ]; then
  echo "docs-check: $errors broken link(s)" >&2
  exit 1
fi
echo "docs-check: ok"
