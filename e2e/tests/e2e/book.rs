//! The book (`docs/`, table of contents `docs/SUMMARY.md`) and the README: every link resolves,
//! every page is in the table of contents, the README's Rust example is the compiled one, and the
//! shell blocks the in-cluster tests and the playground run are where they look for them.

use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
use e2e::docs::{self, LinkReport, RUN_BLOCKS, WITHOUT_CERT_MANAGER};

use e2e::in_cluster::workspace_root;

/// The README and every Markdown page of `docs/`, relative to the workspace root.
fn pages() -> anyhow::Result<Vec<PathBuf>> {
    let mut pages = vec![PathBuf::from("README.md")];
    for entry in std::fs::read_dir(workspace_root().join("docs"))? {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".md") {
            pages.push(Path::new("docs").join(&*name));
        }
    }
    pages.sort();
    Ok(pages)
}

#[test]
fn links_resolve() -> anyhow::Result<()> {
    let pages = pages()?;
    let LinkReport {
        internal,
        external,
        broken,
    } = docs::check_links(&workspace_root(), Path::new("docs"), &pages)?;
    ensure!(
        broken.is_empty(),
        "{} broken links:\n{}",
        broken.len(),
        broken.join("\n")
    );
    // A checker that finds nothing checks nothing: the README alone links a dozen pages.
    ensure!(internal > 100, "only {internal} links found in {pages:?}");
    println!(
        "{internal} links of {} pages resolve; {} external links not followed",
        pages.len(),
        external.len()
    );
    Ok(())
}

/// The checker itself refuses what it must: a missing file, a missing anchor (on another page
/// and on the page itself), a link out of the book, and it ignores links in code.
#[test]
fn link_checker_finds_broken_links() -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("book-links-{}", std::process::id()));
    std::fs::create_dir_all(root.join("docs"))?;
    std::fs::write(root.join("README.md"), "# Top\n")?;
    std::fs::write(
        root.join("docs/a.md"),
        "# A page\n\n## Pins: `x` and y\n\n## Pins: `x` and y\n\n\
         [ok](b.md#b-section) [ok](#pins-x-and-y-1) [ok](b.md) [ok](https://example.invalid/)\n\
         [gone](missing.md) [no anchor](b.md#nope) [self](#nope-here) [out](../README.md)\n\
         `[code](missing-in-code.md)`\n\n```sh\necho [fenced](missing-in-fence.md)\n```\n",
    )?;
    std::fs::write(root.join("docs/b.md"), "# B\n\n## B section\n")?;
    let report = docs::check_links(&root, Path::new("docs"), &[PathBuf::from("docs/a.md")]);
    std::fs::remove_dir_all(&root)?;
    let report = report?;
    assert_eq!(report.internal, 3, "{report:?}");
    assert_eq!(report.external, ["https://example.invalid/"]);
    let broken = report.broken.join("\n");
    for target in [
        "(missing.md)",
        "(b.md#nope)",
        "(#nope-here)",
        "(../README.md)",
    ] {
        assert!(broken.contains(target), "{target} not reported:\n{broken}");
    }
    assert_eq!(report.broken.len(), 4, "{broken}");
    Ok(())
}

#[test]
fn every_page_is_in_the_summary() -> anyhow::Result<()> {
    let summary = std::fs::read_to_string(workspace_root().join("docs/SUMMARY.md"))?;
    let listed = docs::link_targets(&summary);
    for page in pages()? {
        let Ok(name) = page.strip_prefix("docs") else {
            continue;
        };
        let name = name.to_string_lossy();
        if name == "SUMMARY.md" {
            continue;
        }
        ensure!(
            listed.iter().any(|t| *t == name),
            "docs/{name} is not in docs/SUMMARY.md: the book would leave it out"
        );
    }
    Ok(())
}

/// The README's Rust block is, line for line, the marked part of e2e/examples/readme.rs, which
/// `cargo clippy --all-targets` compiles.
#[test]
fn readme_example_is_compiled() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(workspace_root().join("README.md"))?;
    let shown = readme
        .split_once("```rust\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .context("no rust block in the README")?
        .0;
    let example = std::fs::read_to_string(workspace_root().join("e2e/examples/readme.rs"))?;
    let compiled = example
        .split_once("// README begin\n")
        .and_then(|(_, rest)| rest.split_once("\n    // README end"))
        .context("no README markers in e2e/examples/readme.rs")?
        .0;
    let compiled: Vec<&str> = compiled
        .lines()
        .map(|line| line.strip_prefix("    ").unwrap_or(line))
        .collect();
    ensure!(
        shown.lines().eq(compiled.iter().copied()),
        "the README's example differs from e2e/examples/readme.rs:\nREADME:\n{shown}\n\
         example:\n{}",
        compiled.join("\n")
    );
    Ok(())
}

/// Each block the tests run is found, is the install or removal it should be, and the
/// playground names the same page and heading as the tests.
#[test]
fn run_blocks_are_found() -> anyhow::Result<()> {
    for (page, heading) in RUN_BLOCKS {
        let block = docs::shell_block((page, heading))?;
        ensure!(
            block.contains("kubectl "),
            "{page} {heading}: no kubectl command in\n{block}"
        );
        println!("{page} {heading:?}: {} lines", block.lines().count());
    }
    let playground = std::fs::read_to_string(workspace_root().join("e2e/playground-cluster.sh"))?;
    let (page, heading) = WITHOUT_CERT_MANAGER;
    ensure!(
        playground.contains(&format!("doc_block {page} '{heading}'")),
        "e2e/playground-cluster.sh does not run {page} {heading:?}"
    );
    Ok(())
}

/// The section lookup stops at the next heading instead of running the next section's block.
#[test]
fn shell_block_stays_in_its_section() {
    let page = "## One\n\ntext\n\n```yaml\n# not a heading\n```\n\n```sh\necho one\n```\n\n\
                ## Two\n\n## Three\n\n```sh\necho three\n```\n";
    assert_eq!(
        docs::shell_block_in(page, "## One").expect("block"),
        "echo one"
    );
    assert!(docs::shell_block_in(page, "## Two").is_err());
    assert!(docs::shell_block_in(page, "## Four").is_err());
}

/// The README's install lines are the documented installs' commands, as written: each command of
/// its "## Install" block is a line of the install pages' blocks for Helm and the release bundle
/// (which the in-cluster tests run as written) or of the kustomize install with cert-manager
/// (rendered and checked by the `manifests` tests; the node has no cert-manager).
#[test]
fn readme_install_lines_are_documented_commands() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(workspace_root().join("README.md"))?;
    let block = e2e::docs::shell_block_in(&readme, "## Install")?;
    let mut documented = Vec::new();
    for source in [
        ("docs/install.md", "### Install with Helm"),
        ("docs/install.md", "### Install from the release bundle"),
        ("docs/install-kustomize.md", "## With cert-manager"),
    ] {
        documented.extend(e2e::docs::shell_block(source)?.lines().map(str::to_owned));
    }
    let commands: Vec<&str> = block
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .collect();
    ensure!(
        commands.len() >= 4,
        "the README's install block has {} commands: {block}",
        commands.len()
    );
    for command in commands {
        ensure!(
            documented.iter().any(|l| l == command),
            "the README's install line {command:?} is in none of the documented install blocks"
        );
    }
    Ok(())
}
