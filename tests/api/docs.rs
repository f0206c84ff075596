//! The docs agree with the code: `docs/spec.md` defines every rule id the repository cites.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const PREFIXES: [&str; 8] = ["CLI", "HTTP", "ID", "LC", "RS", "RD", "DU", "IN"];

/// Every rule id (`LC-7`, `ID-3a`, ...) in `text`, as whole words.
fn rule_ids(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for (i, _) in text.char_indices() {
        if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
            continue;
        }
        for prefix in PREFIXES {
            let rest = &bytes[i..];
            if !rest.starts_with(prefix.as_bytes()) || rest.get(prefix.len()) != Some(&b'-') {
                continue;
            }
            let mut end = prefix.len() + 1;
            while rest.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
            }
            if end == prefix.len() + 1 {
                continue;
            }
            if rest.get(end).is_some_and(u8::is_ascii_lowercase) {
                end += 1;
            }
            if rest
                .get(end)
                .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
            {
                continue;
            }
            out.push(text[i..i + end].to_string());
        }
    }
    out
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if !path.ends_with("node_modules") {
                files_under(&path, out);
            }
        } else if path.extension().is_some_and(|e| {
            ["rs", "md", "py", "mjs", "sql", "json", "toml"].contains(&e.to_str().unwrap_or(""))
        }) {
            out.push(path);
        }
    }
}

#[test]
fn docs_spec_defines_every_rule_id_the_repository_cites_once() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = std::fs::read_to_string(root.join("docs/spec.md")).expect("docs/spec.md exists");
    // A definition is a list item that starts with the id in bold: `- **LC-7** ...`.
    let mut defined: BTreeMap<String, usize> = BTreeMap::new();
    for line in spec.lines() {
        if let Some(rest) = line.strip_prefix("- **")
            && let Some((id, _)) = rest.split_once("**")
            && rule_ids(id) == [id]
        {
            *defined.entry(id.to_string()).or_default() += 1;
        }
    }
    let twice: Vec<_> = defined.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "defined more than once: {twice:?}");

    let mut files = vec![root.join("README.md")];
    for dir in ["src", "tests", "docs", "benches"] {
        files_under(&root.join(dir), &mut files);
    }
    let mut undefined: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for id in rule_ids(&text) {
            if !defined.contains_key(&id) {
                let shown = file
                    .strip_prefix(root)
                    .unwrap_or(file)
                    .display()
                    .to_string();
                undefined.entry(id).or_default().insert(shown);
            }
        }
    }
    assert!(
        undefined.is_empty(),
        "rule ids cited but not defined in docs/spec.md: {undefined:?}"
    );
    assert!(
        defined.len() >= 50,
        "the contract defines its rules: {defined:?}"
    );
}

#[test]
fn rule_ids_are_found_as_whole_words_only() {
    assert_eq!(
        rule_ids("LC-7, ID-3a and (RD-6); not XID-3, LC-, ID-3ab or ID-12x9"),
        ["LC-7", "ID-3a", "RD-6"]
    );
}
