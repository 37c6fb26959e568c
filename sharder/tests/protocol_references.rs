//! Every "docs/protocol.md §N" cited in the workspace's code, manifests and docs names a section
//! the document has, and no citation of the former, out-of-tree specification is left.
//!
//! Comments cite the protocol by section number only, so a renumbered or missing section would
//! otherwise leave them pointing nowhere without anyone noticing.

use std::fs;
use std::path::{Path, PathBuf};

/// What a citation starts with.
const CITATION: &str = "docs/protocol.md §";

/// Extensions of the files that may cite the protocol.
const EXTENSIONS: &[&str] = &["rs", "md", "yaml", "yml", "sh", "toml", "json"];

/// Fewer citations than this means the walk missed the sources, not that they are all fine.
const MIN_CITATIONS: usize = 50;

/// Every text file under `dir` with one of [`EXTENSIONS`], skipping build output and VCS data.
fn text_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if name != "target" && name != ".git" {
                text_files(&path, out);
            }
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| EXTENSIONS.contains(&e))
        {
            out.push(path);
        }
    }
}

/// The leading decimal digits of `s` as a section number, if any.
fn section_number(s: &str) -> Option<u32> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..end].parse().ok()
}

/// The section numbers `text` cites: the integer part of "docs/protocol.md §N" (and of "§N.M"),
/// plus those of lists and ranges continuing it ("§3, §4", "§1–§14", "§2 and §5").
fn citations(text: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for (start, _) in text.match_indices(CITATION) {
        let mut rest = &text[start + CITATION.len()..];
        while let Some(n) = section_number(rest) {
            found.push(n);
            rest = rest.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.');
            let Some(next) = [", §", "–§", " and §"]
                .iter()
                .find_map(|sep| rest.strip_prefix(sep))
            else {
                break;
            };
            rest = next;
        }
    }
    found
}

/// The numbers of the document's "## N." headings.
fn headings(protocol: &str) -> Vec<u32> {
    protocol
        .lines()
        .filter_map(|line| line.strip_prefix("## "))
        .filter_map(|title| {
            let (number, _) = title.split_once(". ")?;
            number.parse().ok()
        })
        .collect()
}

#[test]
fn citations_name_existing_sections() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let protocol = fs::read_to_string(root.join("docs/protocol.md")).expect("docs/protocol.md");
    let sections = headings(&protocol);
    // Built at run time so that this file does not contain what it looks for.
    // The escaped form is how JSON files (the protocol vectors) write the section sign.
    let old_citations = [concat!("SPEC", " §"), concat!("SPEC", " \\u00a7")];

    let mut files = Vec::new();
    text_files(&root, &mut files);
    let mut count = 0;
    let mut broken = Vec::new();
    let mut old = Vec::new();
    for file in &files {
        // Binary or non-UTF-8 files cannot hold a citation worth checking.
        let Ok(text) = fs::read_to_string(file) else {
            continue;
        };
        let shown = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        if old_citations.iter().any(|c| text.contains(c)) {
            old.push(shown.clone());
        }
        for n in citations(&text) {
            count += 1;
            if !sections.contains(&n) {
                broken.push(format!("{shown}: §{n}"));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "citations of missing sections: {broken:#?}"
    );
    assert!(
        old.is_empty(),
        "files still citing {old_citations:?}: {old:#?}"
    );
    assert!(
        count >= MIN_CITATIONS,
        "only {count} citations found under {}; the walk is broken",
        root.display()
    );
}

#[test]
fn citations_parse_lists_ranges_and_sub_numbers() {
    let text = "see docs/protocol.md §3, §4, §18 and docs/protocol.md §1–§14; \
                docs/protocol.md §9.2's rule, docs/protocol.md §2 and §5, docs/protocol.md §n";
    assert_eq!(citations(text), [3, 4, 18, 1, 14, 9, 2, 5]);
}

#[test]
fn headings_are_numbered_sections_only() {
    let text = "# Title\n## 1. One\n### 1.1 not a section\n## 19. Nineteen\n## Notes\n";
    assert_eq!(headings(text), [1, 19]);
}
