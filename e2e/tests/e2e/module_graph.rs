//! Checks of the workspace's module structure that the compiler does not make: in every crate and
//! tool the top-level modules import each other as a tree (no cycle); in the sharder, its
//! controller's files reach only their siblings through `super::`, and every module table in the
//! crate docs lists exactly the modules its file declares (docs/development.md points at those
//! tables as the code map).
//!
//! The checks read the source as text: cheap, and enough for `use crate::…` paths written the way
//! `rustfmt` writes them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The workspace's root folder.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ is in the workspace")
        .to_path_buf()
}

/// The sharder's sources.
fn src() -> PathBuf {
    workspace().join("sharder/src")
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("source folder is readable") {
            let path = entry.expect("source folder is readable").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The file's code without `//` comments, so that prose naming a module is not an import.
fn code(path: &Path) -> String {
    fs::read_to_string(path)
        .expect("source file is readable")
        .lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules a file declares with `mod name;` or `pub(…) mod name;`, excluding inline ones
/// (`mod tests { … }`).
fn declared_modules(path: &Path) -> BTreeSet<String> {
    code(path)
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line.strip_suffix(';')?;
            let name = rest.rsplit_once("mod ")?.1;
            let prefix = rest.strip_suffix(name)?.trim_end().strip_suffix("mod")?;
            let visible = prefix.is_empty() || prefix.trim_end().starts_with("pub");
            (visible && name.chars().all(|c| c.is_alphanumeric() || c == '_')).then(|| name.into())
        })
        .collect()
}

/// Identifiers that directly follow `prefix` in `text`, including those in a `prefix{a, b::c}`
/// group.
fn names_after(text: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices(prefix) {
        let rest = &text[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            // Each comma-separated item's first segment; nested groups only add deeper segments.
            let mut depth = 0;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        names.insert(ident(&group[i..]));
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            names.insert(ident(rest));
        }
    }
    names.remove("");
    names
}

/// The files of top-level module `name` of the crate rooted in `dir`: `name.rs` and everything
/// under `name/`.
fn module_files_in(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut files = vec![dir.join(format!("{name}.rs"))];
    let sub = dir.join(name);
    if sub.is_dir() {
        files.extend(rust_files(&sub));
    }
    files.retain(|f| f.exists());
    files
}

/// The files of the sharder's top-level module `name`.
fn module_files(name: &str) -> Vec<PathBuf> {
    module_files_in(&src(), name)
}

/// Which top-level modules of the crate whose root file is `root` (`lib.rs` or a binary's
/// `main.rs`, its modules beside it) each module imports through `crate::`.
fn imports_of(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let dir = root.parent().expect("a root file is in a folder");
    let modules = declared_modules(root);
    modules
        .iter()
        .map(|m| {
            let used = module_files_in(dir, m)
                .iter()
                .flat_map(|f| names_after(&code(f), "crate::"))
                .filter(|x| x != m && modules.contains(x))
                .collect();
            (m.clone(), used)
        })
        .collect()
}

/// An import cycle among `imports`, as the path that closes it, if there is one.
fn cycle(imports: &BTreeMap<String, BTreeSet<String>>) -> Option<String> {
    // Depth-first search; a module met again while still on the path closes a cycle.
    fn visit(
        m: &str,
        imports: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<String> {
        if done.contains(m) {
            return None;
        }
        if let Some(at) = path.iter().position(|p| p == m) {
            return Some(format!("{} -> {m}", path[at..].join(" -> ")));
        }
        path.push(m.into());
        for next in &imports[m] {
            if let Some(found) = visit(next, imports, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(m.into());
        None
    }
    let mut done = BTreeSet::new();
    imports
        .keys()
        .find_map(|m| visit(m, imports, &mut Vec::new(), &mut done))
}

#[test]
fn top_level_modules_import_each_other_without_a_cycle() {
    let imports = imports_of(&src().join("lib.rs"));
    assert!(
        imports.len() >= 10,
        "lib.rs declares too few modules: {:?}",
        imports.keys()
    );
    // The check can fail only if the modules import each other at all.
    assert!(imports.values().map(BTreeSet::len).sum::<usize>() >= 10);
    if let Some(found) = cycle(&imports) {
        panic!("import cycle among sharder modules: {found}");
    }
}

/// The crates and tools of more than one file other than the sharder, by root file.
const OTHER_ROOTS: [&str; 5] = [
    "crds/src/lib.rs",
    "e2e/loadtest/src/bin/chaos/main.rs",
    "e2e/loadtest/src/bin/rebalance-load/main.rs",
    "e2e/loadtest/src/bin/ring-compare/main.rs",
    "e2e/loadtest/src/bin/scale-load/main.rs",
];

#[test]
fn every_crate_and_tool_imports_its_modules_without_a_cycle() {
    for root in OTHER_ROOTS {
        let imports = imports_of(&workspace().join(root));
        assert!(imports.len() >= 3, "{root} declares too few modules");
        if let Some(found) = cycle(&imports) {
            panic!("import cycle among the modules of {root}: {found}");
        }
    }
}

#[test]
fn context_stays_with_the_leaders_controllers() {
    // The plugin, the metrics and the views get narrow inputs, not what the controllers share.
    for module in ["cli", "metrics", "views", "webhook", "caches", "core"] {
        for file in module_files(module) {
            assert!(
                !names_after(&code(&file), "crate::").contains("context"),
                "{} uses crate::context",
                file.display()
            );
        }
    }
}

#[test]
fn sharder_controller_files_reach_only_their_siblings() {
    let parent = src().join("controller/sharder.rs");
    let siblings = declared_modules(&parent);
    assert!(siblings.len() >= 5, "too few modules: {siblings:?}");
    for file in rust_files(&src().join("controller/sharder")) {
        let text = code(&file);
        for name in names_after(&text, "super::") {
            // `super::*` in a test module, or `super::super` never: tests live in their file.
            assert!(
                siblings.contains(&name) || (name.is_empty() && text.contains("super::*")),
                "{} reaches into its parent for `super::{name}`",
                file.display()
            );
        }
    }
}

/// The modules named in the first column of a file's `//! | module | what |` table.
fn table_modules(path: &Path) -> Option<BTreeSet<String>> {
    let text = fs::read_to_string(path).expect("source file is readable");
    let mut lines = text
        .lines()
        .skip_while(|l| !l.starts_with("//! | module |"));
    lines.next()?;
    Some(
        lines
            .skip(1)
            .take_while(|l| l.starts_with("//! |"))
            .flat_map(|l| {
                let first = l
                    .trim_start_matches("//! |")
                    .split('|')
                    .next()
                    .unwrap_or_default();
                first
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .collect(),
    )
}

#[test]
fn module_tables_list_every_declared_module() {
    let mut tables = 0;
    for file in rust_files(&src()) {
        let declared = declared_modules(&file);
        let Some(listed) = table_modules(&file) else {
            // A folder of three modules or more is a room the code map must show.
            assert!(
                declared.len() < 3,
                "{} declares {declared:?} but has no `//! | module | … |` table",
                file.display()
            );
            continue;
        };
        tables += 1;
        assert_eq!(
            listed,
            declared,
            "the module table in {} does not match its `mod` declarations",
            file.display()
        );
    }
    // lib.rs and controller/sharder.rs have tables at least; the check must not pass vacuously.
    for required in ["lib.rs", "controller/sharder.rs"] {
        assert!(
            table_modules(&src().join(required)).is_some(),
            "{required} has no module table"
        );
    }
    assert!(tables >= 5);
}

#[test]
fn the_text_parsers_see_what_they_should() {
    assert_eq!(
        names_after(
            "use crate::{a::B, c, d::{e, f}};\nlet x = crate::g::h;",
            "crate::"
        ),
        ["a", "c", "d", "g"].map(String::from).into()
    );
    let dir = std::env::temp_dir().join(format!("module-graph-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let file = dir.join("m.rs");
    fs::write(
        &file,
        "//! | module | what |\n//! |---|---|\n//! | [`a`], `b` | x |\n\nmod a;\npub(crate) mod b;\n// mod c;\nmod tests {}\n",
    )
    .unwrap();
    assert_eq!(declared_modules(&file), ["a", "b"].map(String::from).into());
    let imports: BTreeMap<String, BTreeSet<String>> = [("a", "b"), ("b", "c"), ("c", "a")]
        .into_iter()
        .map(|(m, next)| (m.to_string(), [next.to_string()].into()))
        .collect();
    assert_eq!(cycle(&imports).as_deref(), Some("a -> b -> c -> a"));
    assert_eq!(
        table_modules(&file),
        Some(["a", "b"].map(String::from).into())
    );
    fs::remove_dir_all(&dir).unwrap();
}
