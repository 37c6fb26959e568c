//! Log records are recognised by their `event`, never by their message: the message is for people
//! and may be reworded at any time, so a test, a load tool or the chaos checks that matched it would
//! break, or (worse, for a check that looks for a record's absence) pass blindly. The sharder's
//! events are in `kube_sharder::records`, the shard library's in `kube_sharding::records`; the
//! example shard's are documented with its flags.
//!
//! Two checks over the source, read as text (string literals and comments told apart, nothing
//! more):
//!
//! - no test, tool or helper under `e2e/` names the `message` field as a string, nor writes a
//!   string that is part of a log message of the sharder, the shard library or the example shard;
//! - every record the sharder logs at info level or above carries an `event`.

use std::fs;
use std::path::{Path, PathBuf};

/// The workspace's root folder.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ is in the workspace")
        .to_path_buf()
}

/// Every `.rs` file under `dir`, recursively, build output left out.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("source folder is readable") {
            let path = entry.expect("source folder is readable").path();
            if path.is_dir() {
                if path.file_name().is_none_or(|n| n != "target") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// One piece of Rust source: code, or the content of a string literal (escapes left as written).
#[derive(Debug, PartialEq)]
enum Piece {
    Code(String),
    Str(String),
}

/// Splits `source` into code and string literals, dropping comments. Char literals stay code (so
/// `'"'` opens no string); byte and raw strings (`b"…"`, `r#"…"#`) are strings.
fn pieces(source: &str) -> Vec<Piece> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut code = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\''), or a lifetime, which has no closing quote.
            let end = if next == Some('\\') {
                (i + 2..chars.len()).find(|&j| chars[j] == '\'' && j > i + 2)
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            let end = end.unwrap_or(i);
            code.extend(&chars[i..=end]);
            i = end + 1;
        } else if c == '"' || (matches!(c, 'r' | 'b') && raw_or_byte_start(&chars, i).is_some()) {
            let (hashes, open) = if c == '"' {
                (None, i + 1)
            } else {
                raw_or_byte_start(&chars, i).expect("checked")
            };
            // A `b` or `r` ending an identifier (`pub`, `for`) opens no literal.
            if c != '"' && i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_') {
                code.push(c);
                i += 1;
                continue;
            }
            out.push(Piece::Code(std::mem::take(&mut code)));
            let mut j = open;
            let mut text = String::new();
            while let Some(&d) = chars.get(j) {
                match hashes {
                    None if d == '\\' => {
                        text.push(d);
                        if let Some(&e) = chars.get(j + 1) {
                            text.push(e);
                        }
                        j += 2;
                        continue;
                    }
                    None if d == '"' => break,
                    Some(n) if d == '"' && (1..=n).all(|k| chars.get(j + k) == Some(&'#')) => {
                        j += n;
                        break;
                    }
                    _ => {}
                }
                text.push(d);
                j += 1;
            }
            out.push(Piece::Str(text));
            i = j + 1;
        } else {
            code.push(c);
            i += 1;
        }
    }
    out.push(Piece::Code(code));
    out
}

/// Where a byte or raw string starting at `chars[at]` (`b"`, `r"`, `r#"`, `br#"`) opens: the
/// number of `#` of a raw string (`None` for a byte string, which has escapes) and the index of
/// its first character.
fn raw_or_byte_start(chars: &[char], at: usize) -> Option<(Option<usize>, usize)> {
    let mut i = at;
    if chars.get(i) == Some(&'b') {
        i += 1;
    }
    if chars.get(i) != Some(&'r') {
        return (i > at && chars.get(i) == Some(&'"')).then_some((None, i + 1));
    }
    i += 1;
    let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
    (chars.get(i + hashes) == Some(&'"')).then_some((Some(hashes), i + hashes + 1))
}

/// The invocations of `tracing`'s record macros in `source`: the macro's level and its arguments
/// as pieces.
fn log_macros(source: &str) -> Vec<(String, Vec<Piece>)> {
    let pieces = pieces(source);
    let mut found = Vec::new();
    for (at, piece) in pieces.iter().enumerate() {
        let Piece::Code(code) = piece else { continue };
        for level in ["trace", "debug", "info", "warn", "error"] {
            let opener = format!("{level}!(");
            let mut from = 0;
            while let Some(offset) = code[from..].find(&opener) {
                let start = from + offset;
                from = start + opener.len();
                if code[..start]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_')
                {
                    continue;
                }
                found.push((level.to_string(), arguments(&pieces, at, from)));
            }
        }
    }
    found
}

/// The arguments of a macro whose `(` ends at byte `from` of code piece `at`: every piece up to
/// the matching `)`.
fn arguments(pieces: &[Piece], at: usize, from: usize) -> Vec<Piece> {
    let mut depth = 1;
    let mut args = Vec::new();
    for (index, piece) in pieces.iter().enumerate().skip(at) {
        match piece {
            Piece::Str(text) => args.push(Piece::Str(text.clone())),
            Piece::Code(code) => {
                let code = if index == at { &code[from..] } else { code };
                let mut kept = String::new();
                for c in code.chars() {
                    match c {
                        '(' | '[' | '{' => depth += 1,
                        ')' | ']' | '}' => depth -= 1,
                        _ => {}
                    }
                    if depth == 0 {
                        args.push(Piece::Code(kept));
                        return args;
                    }
                    kept.push(c);
                }
                args.push(Piece::Code(kept));
            }
        }
    }
    args
}

/// Shortest string that counts as part of a message. Only phrases count, too (a space inside):
/// single words ("namespace", "reconcile") name fields and resources as often as they occur in
/// messages.
const MIN_MATCHED: usize = 8;

/// The string constants of `source` (`const NAME: &str = "…";`), by name.
fn string_constants(source: &str) -> Vec<(String, String)> {
    let pieces = pieces(source);
    let mut constants = Vec::new();
    for pair in pieces.windows(2) {
        let [Piece::Code(code), Piece::Str(text)] = pair else {
            continue;
        };
        let Some(head) = code.trim_end().strip_suffix(": &str =") else {
            continue;
        };
        let Some((_, name)) = head.rsplit_once("const ") else {
            continue;
        };
        constants.push((name.trim().to_string(), text.clone()));
    }
    constants
}

/// The fixed parts of the log messages in `source`: each message (the last string argument of a
/// record macro, with the string constants of the file it names as `{NAME}` put in) split at its
/// other `{…}` placeholders, the parts of at least [`MIN_MATCHED`] characters.
fn message_parts(source: &str) -> Vec<String> {
    let constants = string_constants(source);
    let mut parts = Vec::new();
    for (_, args) in log_macros(source) {
        let Some(message) = args.iter().rev().find_map(|p| match p {
            Piece::Str(text) => Some(text),
            Piece::Code(_) => None,
        }) else {
            continue;
        };
        let mut message = message.clone();
        for (name, value) in &constants {
            message = message.replace(&format!("{{{name}}}"), value);
        }
        for part in message.split(['{', '}']).step_by(2) {
            let part = part.trim();
            if part.chars().count() >= MIN_MATCHED {
                parts.push(part.to_string());
            }
        }
    }
    parts
}

/// Code right before a string that compares something with it.
const COMPARED_AFTER: [&str; 8] = [
    "contains(",
    "starts_with(",
    "ends_with(",
    "find(",
    "matches(",
    "strip_prefix(",
    "==",
    "!=",
];

/// What in `source` (a test, tool or helper) matches log records by message: the string
/// `"message"` (the field's name as a key), and phrases of at least [`MIN_MATCHED`] characters
/// that are part of one of `messages` and compared with something (`contains("…")`, `== "…"`,
/// a match arm `"…" =>`). A phrase that merely occurs in a message, as a test's own error
/// context say, is no match.
fn message_matches(source: &str, messages: &[String]) -> Vec<String> {
    let pieces = pieces(source);
    let code_at = |index: usize| match pieces.get(index) {
        Some(Piece::Code(code)) => code.as_str(),
        _ => "",
    };
    let mut found = Vec::new();
    for (index, piece) in pieces.iter().enumerate() {
        let Piece::Str(text) = piece else { continue };
        let trimmed = text.trim();
        let before = index.checked_sub(1).map_or("", code_at).trim_end();
        let after = code_at(index + 1).trim_start();
        let compared = COMPARED_AFTER.iter().any(|c| before.ends_with(c))
            || after.starts_with("==")
            || after.starts_with("=>");
        if trimmed == "message" {
            found.push("the key \"message\"".to_string());
        } else if compared
            && trimmed.chars().count() >= MIN_MATCHED
            && trimmed.contains(' ')
            && let Some(message) = messages.iter().find(|m| m.contains(trimmed))
        {
            found.push(format!("{trimmed:?}, part of the log message {message:?}"));
        }
    }
    found
}

/// The record macros at info level or above in `source` without an `event` field.
fn records_without_event(source: &str) -> Vec<String> {
    log_macros(source)
        .into_iter()
        .filter(|(level, _)| matches!(level.as_str(), "info" | "warn" | "error"))
        .filter(|(_, args)| {
            !args.iter().any(|p| match p {
                Piece::Code(code) => code.split(',').any(|a| a.trim().starts_with("event =")),
                Piece::Str(_) => false,
            })
        })
        .map(|(level, args)| {
            let message = args.iter().rev().find_map(|p| match p {
                Piece::Str(text) => Some(text.as_str()),
                Piece::Code(_) => None,
            });
            format!("{level}!: {message:?}")
        })
        .collect()
}

#[test]
fn tests_and_tools_match_log_records_by_event_only() {
    let root = workspace();
    let mut messages = Vec::new();
    for dir in ["sharder", "shard"] {
        for path in rust_files(&root.join(dir)) {
            let source = fs::read_to_string(&path).expect("source file is readable");
            messages.extend(message_parts(&source));
        }
    }
    // The check has something to compare with: the sharder's end-of-sync message, say.
    assert!(
        messages.iter().any(|m| m.contains("finished sync")),
        "no log messages found in the sources: {} parts",
        messages.len()
    );
    let this_file = Path::new(file!()).file_name().expect("a file name");
    let mut problems = Vec::new();
    let files = rust_files(&root.join("e2e"));
    assert!(files.len() > 50, "e2e/ has only {} Rust files", files.len());
    for path in files {
        if path.file_name() == Some(this_file) {
            continue;
        }
        let source = fs::read_to_string(&path).expect("source file is readable");
        for found in message_matches(&source, &messages) {
            problems.push(format!("{}: {found}", path.display()));
        }
    }
    assert!(
        problems.is_empty(),
        "match log records by their `event` (kube_sharder::records), not by message:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_sharder_record_at_info_and_above_has_an_event() {
    let mut problems = Vec::new();
    let mut macros = 0;
    for path in rust_files(&workspace().join("sharder/src")) {
        let source = fs::read_to_string(&path).expect("source file is readable");
        macros += log_macros(&source).len();
        for found in records_without_event(&source) {
            problems.push(format!("{}: {found}", path.display()));
        }
    }
    assert!(
        macros > 50,
        "only {macros} record macros found in sharder/src"
    );
    assert!(
        problems.is_empty(),
        "records without an `event` (add one from kube_sharder::records):\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_checks_find_what_they_look_for() {
    let sharder = r##"
        // info!("commented out, not a message");
        let quote = '"';
        tracing::info!(event = records::EVENT_SYNC_FINISHED, %ring, listed, "finished sync of ring");
        warn!(%error, ring = %name, "sync failed for {ring} after {n} tries");
        tracing::debug!(%peer, "TLS handshake failed");
        let url = "https://example"; error!("no event here");
        pub const SYNC_STARTED: &str = "starting sync of ring";
        info!(%ring, "{SYNC_STARTED}");
    "##;
    assert_eq!(
        message_parts(sharder),
        [
            "finished sync of ring",
            "sync failed for",
            "TLS handshake failed",
            "no event here",
            "starting sync of ring",
        ]
    );
    assert_eq!(
        records_without_event(sharder),
        [
            r#"warn!: Some("sync failed for {ring} after {n} tries")"#,
            r#"error!: Some("no event here")"#,
            r#"info!: Some("{SYNC_STARTED}")"#,
        ]
    );

    let messages = message_parts(sharder);
    // Each way a test matched messages before: by a field key, by part of a message.
    for matching in [
        r#"r["fields"]["message"] == EVENT_SYNC_FINISHED"#,
        r#"record.get("message")"#,
        r#"r.to_string().contains("finished sync")"#,
        r#"line.contains(r"TLS handshake")"#,
        r#"match message { "sync failed for" => 1, _ => 0 }"#,
        r#"message == "no event here""#,
        r#"line.contains("starting sync")"#,
    ] {
        assert_eq!(
            message_matches(matching, &messages).len(),
            1,
            "{matching} not found"
        );
    }
    // By event; comments, JSON fixtures holding messages, short words, a message's phrase as a
    // test's own text: nothing found.
    for fine in [
        r#"r["event"] == EVENT_SYNC_FINISHED && r["ring"] == "ClusterRing/x""#,
        r#"// waits for the "finished sync of ring" record"#,
        r##"r#"{"message":"finished sync of ring","event":"sync_finished"}"#"##,
        r#"ensure!(text.contains("failed"), "{text}")"#,
        r#"stream.await.context("TLS handshake failed")?"#,
    ] {
        assert_eq!(
            message_matches(fine, &messages),
            Vec::<String>::new(),
            "{fine}"
        );
    }
}
