//! The public API of `kube-sharding` and `kube-sharding-api`, listed in a checked-in file per
//! crate (`shard/public-api.txt`, `crds/public-api.txt`), so that a change to it shows in review
//! as a change to that file: a decision, not a side effect.
//!
//! The listing is read from the source as text (rustdoc's JSON output needs a nightly
//! toolchain): every `pub` declaration outside test code, with the type or `impl` it belongs to,
//! enum variants and public fields, and the root's `pub use` lines. It relies on the layout
//! `rustfmt` gives the code (items at column 0, their members four columns in), which CI keeps.
//! Items in `pub(crate)` or private modules that are declared `pub` but not re-exported are listed
//! too; the crates keep such items `pub(crate)`.
//!
//! After an intended change, regenerate the listings with
//! `UPDATE_PUBLIC_API=1 cargo test -p kube-sharding --test public_api` and commit them.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The workspace's root folder.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("shard/ is in the workspace")
        .to_path_buf()
}

/// The crate's source files, test files excluded (`tests.rs`, `tests_*.rs`, `testing.rs` and
/// everything under a `tests/` folder are compiled only for tests).
fn source_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("source folder is readable") {
            let path = entry.expect("source folder is readable").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if path.is_dir() {
                if name != "tests" {
                    stack.push(path);
                }
            } else if name.ends_with(".rs")
                && name != "tests.rs"
                && name != "testing.rs"
                && !name.starts_with("tests_")
            {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// How many brackets `text` leaves open (`(`, `{`, `<`; the `>` of `->` and `=>` closes none).
fn open_brackets(text: &str) -> i32 {
    let mut depth = 0;
    let mut previous = ' ';
    for c in text.chars() {
        match c {
            '(' | '{' | '<' => depth += 1,
            ')' | '}' => depth -= 1,
            '>' if previous != '-' && previous != '=' => depth -= 1,
            _ => {}
        }
        previous = c;
    }
    depth
}

/// One declaration starting at `lines[at]`, joined into one line up to its body or its end: a
/// function, `impl` or `use` ends at its `{` or `;`, a field or variant also at its `,`.
fn declaration(lines: &[&str], at: usize) -> String {
    let mut text = String::new();
    for line in &lines[at..] {
        let line = line.trim();
        if !text.is_empty() && !text.ends_with(['(', '<', '{']) {
            text.push(' ');
        }
        text.push_str(line);
        let signature = text.contains("fn ") || text.starts_with("impl");
        let is_use = text.starts_with("pub use");
        let body = line.ends_with('{') && open_brackets(&text[..text.len() - 1]) == 0;
        if line.ends_with(';') || (body && !is_use) {
            break;
        }
        if line.ends_with(',') && !signature && !is_use && open_brackets(&text) == 0 {
            break;
        }
    }
    let text = text
        .trim_end_matches('{')
        .trim_end()
        .trim_end_matches([';', ','])
        .trim();
    // Trailing commas before a closing bracket, as rustfmt writes multi-line lists.
    text.replace(", )", ")").replace(", }", "}")
}

/// Whether `code` starts like a field: `name: Type`.
fn is_field(code: &str) -> bool {
    let name: String = code
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    !name.is_empty() && code[name.len()..].starts_with(':') && !code[name.len()..].starts_with("::")
}

/// The public API declared in one file, as listing lines.
fn declarations(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    // The column-0 item whose body the scan is in: its kind and name, or `None` outside
    // listed items (private ones, test modules).
    let mut context: Option<(String, String)> = None;
    let mut test_only = false;
    let mut variant = String::new();
    for (at, line) in lines.iter().enumerate() {
        let indent = line.len() - line.trim_start().len();
        let code = line.trim();
        if code.is_empty() || code.starts_with("//") {
            continue;
        }
        if indent == 0 {
            if code == "#[cfg(test)]" {
                test_only = true;
                continue;
            }
            if code.starts_with("#[") || code == "}" || code.starts_with(')') {
                continue;
            }
            let skip = std::mem::take(&mut test_only);
            context = None;
            if skip {
                continue;
            }
            if code.starts_with("impl") && !code.contains(" for ") {
                let header = declaration(&lines, at);
                if !header.contains(" for ") {
                    context = Some(("impl".into(), header));
                }
            } else if let Some(rest) = code.strip_prefix("pub ") {
                found.push(declaration(&lines, at));
                for kind in ["struct", "enum", "trait"] {
                    if let Some(name) = rest.strip_prefix(kind).map(str::trim_start) {
                        let name: String = name
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        context = Some((kind.into(), name));
                    }
                }
            }
            continue;
        }
        let Some((kind, name)) = &context else {
            continue;
        };
        if code.starts_with("#[") || code.starts_with("}") || code.starts_with(')') {
            continue;
        }
        match (kind.as_str(), indent) {
            ("impl", 4) if code.starts_with("pub ") => {
                found.push(format!("{name}: {}", declaration(&lines, at)));
            }
            ("struct", 4) if code.starts_with("pub ") => {
                found.push(format!("struct {name}: {}", declaration(&lines, at)));
            }
            ("trait", 4) if code.starts_with("fn ") || code.starts_with("type ") => {
                found.push(format!("trait {name}: {}", declaration(&lines, at)));
            }
            ("enum", 4) if code.starts_with(|c: char| c.is_ascii_uppercase()) => {
                variant = code
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                found.push(format!("enum {name}: {}", declaration(&lines, at)));
            }
            // A field of a struct variant (not the continuation of a multi-line attribute).
            ("enum", 8) if !variant.is_empty() && is_field(code) => {
                found.push(format!(
                    "enum {name}: {variant} field {}",
                    declaration(&lines, at)
                ));
            }
            _ => {}
        }
    }
    found
}

/// The listing of the crate whose sources are in `src` (relative to the workspace).
fn listing(src: &str) -> String {
    let dir = workspace().join(src);
    let mut entries = BTreeSet::new();
    for file in source_files(&dir) {
        let text = fs::read_to_string(&file).expect("source file is readable");
        entries.extend(declarations(&text));
    }
    let mut out = String::new();
    for entry in entries {
        out.push_str(&entry);
        out.push('\n');
    }
    out
}

/// Compares the listing of `src` with the checked-in `listed`, or rewrites it with
/// `UPDATE_PUBLIC_API` set.
fn check(src: &str, listed: &str) {
    let current = listing(src);
    let path = workspace().join(listed);
    if std::env::var_os("UPDATE_PUBLIC_API").is_some() {
        fs::write(&path, &current).expect("listing is writable");
        return;
    }
    let checked_in = fs::read_to_string(&path).unwrap_or_default();
    if checked_in != current {
        let old: BTreeSet<&str> = checked_in.lines().collect();
        let new: BTreeSet<&str> = current.lines().collect();
        let gone: Vec<_> = old.difference(&new).collect();
        let added: Vec<_> = new.difference(&old).collect();
        panic!(
            "the public API of {src} changed; if intended, run \
             `UPDATE_PUBLIC_API=1 cargo test -p kube-sharding --test public_api` and commit \
             {listed}\n  gone: {gone:#?}\n  added: {added:#?}"
        );
    }
}

#[test]
fn the_shard_library_api_is_as_listed() {
    check("shard/src", "shard/public-api.txt");
}

#[test]
fn the_protocol_crate_api_is_as_listed() {
    check("crds/src", "crds/public-api.txt");
}

#[test]
fn the_listing_sees_what_it_should() {
    let text = "\
//! Docs.
use std::fmt;

pub use crate::a::{
    B, C,
};

/// A type.
#[derive(Debug)]
pub struct Thing {
    /// A field.
    pub name: String,
    hidden: u8,
}

pub(crate) struct Internal;

impl Thing {
    /// A method.
    pub fn new(
        name: String,
    ) -> Self {
        Self { name, hidden: 0 }
    }

    fn private(&self) {}

    pub(crate) fn internal(&self) {}
}

impl fmt::Display for Thing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(\"{}\")
    }
}

pub enum Kind {
    /// One.
    One,
    Two(u8),
    Three {
        /// Field.
        x: u32,
    },
    #[error(
        \"a long message\"
    )]
    Four,
}

pub const LIMIT: u32 = 3;

#[cfg(test)]
pub fn only_in_tests() {}

#[cfg(test)]
mod tests {
    pub fn helper() {}
}
";
    assert_eq!(
        declarations(text),
        [
            "pub use crate::a::{B, C}",
            "pub struct Thing",
            "struct Thing: pub name: String",
            "impl Thing: pub fn new(name: String) -> Self",
            "pub enum Kind",
            "enum Kind: One",
            "enum Kind: Two(u8)",
            "enum Kind: Three",
            "enum Kind: Three field x: u32",
            "enum Kind: Four",
            "pub const LIMIT: u32 = 3",
        ]
    );
}
