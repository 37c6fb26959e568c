//! The documentation as the tests read it: the shell blocks a page tells users to run (the
//! in-cluster tests and the playground run them as written), and the links of the book and the
//! README, checked the way mdbook and GitHub resolve them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, bail, ensure};

use crate::in_cluster::workspace_root;

/// A shell block of the documentation that users copy and the tests run as written: the page
/// (from the workspace root) and the exact heading line of its section.
pub type DocBlock = (&'static str, &'static str);

/// The sharder installed without cert-manager: the in-cluster tests' install, and the
/// playground's in a real cluster (e2e/playground-cluster.sh names the same page and heading).
pub const WITHOUT_CERT_MANAGER: DocBlock = ("docs/install-kustomize.md", "## Without cert-manager");
/// The example ring applied and one Secret assigned.
pub const EXAMPLE_RING: DocBlock = ("docs/getting-started.md", "## The example ring");
/// Pins on the example ring.
pub const PINS: DocBlock = (
    "docs/rings.md",
    "## Pins: an object or a namespace on a chosen shard",
);
/// Rings, sharder and CRDs removed.
pub const UNINSTALL: DocBlock = ("docs/install-kustomize.md", "## Uninstall");
/// Every block the in-cluster tests run.
pub const RUN_BLOCKS: [DocBlock; 4] = [WITHOUT_CERT_MANAGER, EXAMPLE_RING, PINS, UNINSTALL];

/// The first `sh` block of the section under the line `heading` (exactly, e.g.
/// `## Without cert-manager`) of `page`, a path from the workspace root. The block must come
/// before the next heading, so a section that loses its block is an error rather than the next
/// section's block run in its place.
pub fn shell_block((page, heading): DocBlock) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(workspace_root().join(page))
        .with_context(|| format!("failed to read {page}"))?;
    shell_block_in(&text, heading).with_context(|| format!("in {page}"))
}

/// [`shell_block`] on a page's text.
pub fn shell_block_in(text: &str, heading: &str) -> anyhow::Result<String> {
    let mut fenced = false;
    let mut lines = text.lines();
    loop {
        let line = lines
            .next()
            .with_context(|| format!("no heading {heading:?}"))?;
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line == heading {
            break;
        }
    }
    let mut block: Option<Vec<&str>> = None;
    for line in lines {
        match &mut block {
            Some(block) if line == "```" => {
                ensure!(!block.is_empty(), "empty sh block under {heading:?}");
                return Ok(block.join("\n"));
            }
            Some(block) => block.push(line),
            None if line == "```sh" => block = Some(Vec::new()),
            // Another fence (yaml, text): its lines are no headings.
            None if line.starts_with("```") => fenced = !fenced,
            None if !fenced && line.starts_with('#') => break,
            None => {}
        }
    }
    bail!("no sh block in the section {heading:?}")
}

/// The lines of a Markdown text outside fenced code blocks, with whether each is a heading.
fn prose_lines(text: &str) -> impl Iterator<Item = (&str, bool)> {
    let mut fenced = false;
    text.lines().filter_map(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return None;
        }
        (!fenced).then_some((line, line.starts_with('#')))
    })
}

/// The anchor ids of a page's headings, as mdbook (and GitHub) derive them: the heading's text
/// without Markdown, lower-cased, whitespace to `-`, keeping only alphanumerics, `-` and `_`; a
/// repeated id gets `-1`, `-2`, ...
pub fn heading_ids(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut ids = BTreeSet::new();
    for (line, heading) in prose_lines(text) {
        if !heading {
            continue;
        }
        let title = line.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let base = anchor_of(&plain_text(title.trim()));
        let n = seen.entry(base.clone()).or_insert(0);
        ids.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    ids
}

/// A heading's text as rendered: link targets, backticks and emphasis removed.
fn plain_text(markdown: &str) -> String {
    let mut out = String::new();
    let mut rest = markdown;
    while let Some(start) = rest.find("](") {
        out.push_str(&rest[..start]);
        rest = &rest[start + 2..];
        rest = rest.find(')').map_or("", |end| &rest[end + 1..]);
    }
    out.push_str(rest);
    out.chars()
        .filter(|c| !matches!(c, '`' | '*' | '['))
        .collect()
}

fn anchor_of(text: &str) -> String {
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The inline link targets of a Markdown text (`[text](target)`), outside code blocks and code
/// spans.
pub fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for (line, _) in prose_lines(text) {
        // Code spans hold commands and paths, never links.
        let prose: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, part)| part)
            .collect::<Vec<_>>()
            .join("");
        let mut rest = prose.as_str();
        while let Some(start) = rest.find("](") {
            rest = &rest[start + 2..];
            match rest.find(')') {
                Some(end) => {
                    targets.push(rest[..end].to_string());
                    rest = &rest[end + 1..];
                }
                None => break,
            }
        }
    }
    targets
}

/// What [`check_links`] found.
#[derive(Debug, Default)]
pub struct LinkReport {
    /// Links to a file of the checkout, anchors included, that resolve.
    pub internal: usize,
    /// Links to other sites: not followed (CI reaches none).
    pub external: Vec<String>,
    /// One line per link that does not resolve: the page, the target and why.
    pub broken: Vec<String>,
}

/// Checks every link of `pages` (paths relative to `root`): a relative target must name a file
/// or directory under `root` (under `book_root` for a page inside it: mdbook copies nothing
/// else), and an anchor must be a heading of the Markdown page it names (of the page itself for
/// `#anchor`).
pub fn check_links(root: &Path, book_root: &Path, pages: &[PathBuf]) -> anyhow::Result<LinkReport> {
    let mut report = LinkReport::default();
    for page in pages {
        let text = std::fs::read_to_string(root.join(page))
            .with_context(|| format!("failed to read {}", page.display()))?;
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                report.external.push(target);
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() {
                page.clone()
            } else {
                normalize(&page.parent().unwrap_or(Path::new("")).join(path))
            };
            let why = if page.starts_with(book_root) && !resolved.starts_with(book_root) {
                Some(format!("leaves the book ({})", book_root.display()))
            } else if resolved.as_os_str().is_empty() || !root.join(&resolved).exists() {
                Some("no such file".to_string())
            } else {
                match anchor {
                    Some(anchor) if resolved.extension().is_some_and(|e| e == "md") => {
                        let target_text = std::fs::read_to_string(root.join(&resolved))?;
                        (!heading_ids(&target_text).contains(anchor)).then(|| {
                            format!(
                                "no heading with the anchor #{anchor} in {}",
                                resolved.display()
                            )
                        })
                    }
                    Some(anchor) => Some(format!("an anchor #{anchor} on a file that is no page")),
                    None => None,
                }
            };
            match why {
                Some(why) => report
                    .broken
                    .push(format!("{}: ({target}): {why}", page.display())),
                None => report.internal += 1,
            }
        }
    }
    Ok(report)
}

/// `a/b/../c` as `a/c`; an empty path when it climbs out of the root.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                if !out.pop() {
                    return PathBuf::new();
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}
