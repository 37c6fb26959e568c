# Compares a CycloneDX SBOM of one binary with Cargo's own view of what that binary is built from.
# Input: null (jq -n). Arguments:
#   $meta[0]  `cargo metadata --locked --format-version 1 --filter-platform <host>` of the workspace
#   $bom[0]   the SBOM
#   $pkg      the workspace package that builds the binary
#   $bin      the binary's name
# Output: one line per problem; none when the SBOM lists exactly the packages the binary's
# package reaches through normal and build dependencies (dev-dependencies excluded), each with its
# locked version.

# Every package id reachable from the ids in $frontier, not counting those already in $seen.
def reach($edges; $seen; $frontier):
  if $frontier == [] then $seen
  else ([$frontier[] | $edges[.][]] | unique - $seen) as $new
  | reach($edges; $seen + $new; $new)
  end;

$meta[0] as $m
| $bom[0] as $b
| ($m.packages | map({key: .id, value: "\(.name) \(.version)"}) | from_entries) as $name_of
| ($m.resolve.nodes
   | map({key: .id, value: [.deps[] | select(any(.dep_kinds[]; .kind != "dev")) | .pkg]})
   | from_entries) as $edges
| [$m.packages[] | select(.name == $pkg and .source == null)] as $roots
| if ($roots | length) != 1 then "no single workspace package named \($pkg) in cargo metadata"
  else
    $roots[0] as $root
    | [reach($edges; [$root.id]; [$root.id])[] | select(. != $root.id) | $name_of[.]] | unique
    as $expected
    | [($b.components // [])[] | "\(.name) \(.version)"] as $listed
    | (if $b.bomFormat != "CycloneDX" then "not a CycloneDX document" else empty end),
      (if $b.metadata.component.name != $bin
         then "describes \($b.metadata.component.name), not the binary \($bin)" else empty end),
      (if $b.metadata.component.version != $root.version
         then "describes version \($b.metadata.component.version) of \($bin), Cargo.toml says \($root.version)"
         else empty end),
      (if ($expected | length) < 10
         then "only \($expected | length) dependencies found for \($pkg): the closure is wrong"
         else empty end),
      ($expected - $listed | .[] | "missing: \(.)"),
      ($listed | unique - $expected | .[] | "listed but not a dependency: \(.)"),
      ($listed | group_by(.) | map(select(length > 1) | .[0]) | .[] | "listed twice: \(.)")
  end
