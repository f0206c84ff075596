//! The docs agree with the code: `docs/spec.md` defines every rule id the repository cites.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const PREFIXES: [&str; 9] = ["CLI", "HTTP", "ID", "LC", "RS", "RD", "DU", "IN", "GM"];

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

/// The keys `docs/configuration.md` documents, as dotted paths (`workers.lease_secs`,
/// `backends.name`): the first column of each table under the key sections.
fn documented_config_keys(doc: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut section: Option<String> = None;
    for line in doc.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            let heading = heading.trim_matches('`');
            section = if heading == "Top-level keys" {
                Some(String::new())
            } else if heading.starts_with('[') {
                Some(format!(
                    "{}.",
                    heading.trim_matches(|c| c == '[' || c == ']')
                ))
            } else {
                None
            };
            continue;
        }
        let Some(prefix) = &section else { continue };
        if let Some(rest) = line.strip_prefix("| `")
            && let Some((key, _)) = rest.split_once('`')
        {
            keys.insert(format!("{prefix}{key}"));
        }
    }
    keys
}

/// The keys the code accepts, from the config struct itself.
fn config_keys() -> BTreeSet<String> {
    use holdfast::config::{Backend, Config, ModelRewrite, Namespace, Passthrough, Price};
    let config = Config {
        backends: vec![Backend {
            name: "b".into(),
            kind: holdfast::provider::Provider::Openai,
            base_url: "http://x/v1".into(),
            api_key_env: None,
        }],
        model_rewrites: vec![ModelRewrite {
            pattern: "m".into(),
            backend: "b".into(),
            model: None,
        }],
        namespaces: vec![Namespace {
            name: "n".into(),
            api_keys: vec!["k".into()],
            callback_url: None,
            callback_secrets: Vec::new(),
            callback_include_body: None,
            max_held_requests: None,
        }],
        passthrough: vec![Passthrough {
            path: "/v1/moderations".into(),
            backend: "b".into(),
        }],
        prices: vec![Price {
            backend: "b".into(),
            model: "m".into(),
            input_per_mtok: 1.0,
            output_per_mtok: 1.0,
            cached_input_per_mtok: None,
            cache_write_per_mtok: None,
            cache_write_1h_per_mtok: None,
        }],
        ..Config::default()
    };
    let mut keys = BTreeSet::new();
    let serde_json::Value::Object(top) = serde_json::to_value(&config).unwrap() else {
        panic!("config serialises to an object")
    };
    for (key, value) in top {
        let nested = match &value {
            serde_json::Value::Object(table) => Some(table.clone()),
            serde_json::Value::Array(items) => items.first().and_then(|v| v.as_object().cloned()),
            _ => None,
        };
        if let Some(table) = nested {
            keys.extend(table.keys().map(|k| format!("{key}.{k}")));
        }
        keys.insert(key);
    }
    keys
}

#[test]
fn docs_configuration_lists_exactly_the_keys_the_code_accepts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let documented = documented_config_keys(&doc);
    let code = config_keys();
    let undocumented: Vec<_> = code.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&code).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "keys the code accepts but docs/configuration.md does not list: {undocumented:?}; \
         keys it lists that the code does not know: {unknown:?}"
    );
}

/// The `| module | uses |` table of `src/lib.rs`: each module and the modules it may use.
fn dependency_table(lib: &str) -> BTreeMap<String, BTreeSet<String>> {
    let names = |cell: &str| -> BTreeSet<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    lib.lines()
        .filter_map(|l| l.strip_prefix("//! | `"))
        .filter_map(|row| {
            let (module, rest) = row.split_once('`')?;
            let uses = rest.trim_start_matches(' ').strip_prefix('|')?;
            Some((module.to_string(), names(uses)))
        })
        .collect()
}

/// The crate modules a module's source names: as `crate::NAME`, in a group `crate::{A, B::x}`,
/// or through as many `super::` as the file is deep (`super::super::NAME` from
/// `src/worker/attempt.rs`), grouped or not.
fn used_modules(root: &Path, module: &str) -> BTreeSet<String> {
    let mut files = Vec::new();
    let dir = root.join("src").join(module);
    if dir.is_dir() {
        files_under(&dir, &mut files);
    }
    let file = root.join("src").join(format!("{module}.rs"));
    if file.is_file() {
        files.push(file);
    }
    let mut used = BTreeSet::new();
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs"))
    {
        let text = std::fs::read_to_string(file).unwrap();
        let depth = module_depth(&root.join("src"), file);
        used.extend(
            crate_level_names(&text, depth)
                .into_iter()
                .filter(|name| name != module),
        );
    }
    used
}

/// How many modules deep `file` is below the crate root `src`: `src/hub.rs` and
/// `src/worker/mod.rs` 1, `src/worker/attempt.rs` 2.
fn module_depth(src: &Path, file: &Path) -> usize {
    let parts = file.strip_prefix(src).unwrap().components().count();
    if file.file_name().is_some_and(|n| n == "mod.rs") {
        parts - 1
    } else {
        parts
    }
}

/// The crate-level module names `text` uses (see [`used_modules`]); `depth` as
/// [`module_depth`].
fn crate_level_names(text: &str, depth: usize) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut roots: Vec<usize> = Vec::new();
    for (i, _) in text.match_indices("crate::") {
        if i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
            roots.push(i + "crate::".len());
        }
    }
    let supers = "super::".repeat(depth);
    for (i, _) in text.match_indices(supers.as_str()) {
        let before_ok = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        let after = i + supers.len();
        if before_ok && !text[after..].starts_with("super::") {
            roots.push(after);
        }
    }
    for at in roots {
        names.extend(group_heads(&text[at..]));
    }
    names
}

/// The first path segment of each path in `rest`: `name::...` gives `name`; a group
/// `{a, b::c, d::{e}}` gives `a`, `b`, `d`.
fn group_heads(rest: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    let Some(group) = rest.strip_prefix('{') else {
        let name = ident(rest);
        return if name.is_empty() {
            Vec::new()
        } else {
            vec![name]
        };
    };
    let mut heads = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                heads.push(ident(group[start..i].trim_start()));
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                heads.push(ident(group[start..i].trim_start()));
                start = i + 1;
            }
            _ => {}
        }
    }
    heads.retain(|h| !h.is_empty() && h != "self");
    heads
}

#[test]
fn modules_use_only_what_the_dependency_rule_in_lib_rs_allows_and_it_has_no_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let table = dependency_table(&lib);
    // Every module declared in lib.rs has a row.
    let declared: BTreeSet<String> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim_start_matches("pub ");
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect();
    let rows: BTreeSet<String> = table.keys().cloned().collect();
    assert_eq!(
        declared, rows,
        "src/lib.rs: the dependency table's rows are not the modules"
    );
    let mut violations = Vec::new();
    for (module, allowed) in &table {
        // Names that are not modules (`crate::store::redact_url` is `store`'s; an inline
        // `mod tests` makes `super::` its parent's) are not the table's business.
        for used in used_modules(root, module)
            .into_iter()
            .filter(|u| table.contains_key(u))
        {
            if !allowed.contains(&used) {
                violations.push(format!("{module} uses {used}"));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "not allowed by src/lib.rs's dependency table: {violations:?}"
    );
    // No cycle: repeatedly remove modules that use nothing left.
    let mut left = table.clone();
    while let Some(leaf) = left
        .iter()
        .find(|(_, uses)| uses.iter().all(|u| !left.contains_key(u)))
        .map(|(m, _)| m.clone())
    {
        left.remove(&leaf);
    }
    assert!(
        left.is_empty(),
        "the dependency table has a cycle among {left:?}"
    );
    // The rules issue 12 names.
    for (module, never) in [
        ("store", "hub"),
        ("store", "worker"),
        ("hub", "http"),
        ("hub", "worker"),
    ] {
        assert!(
            !table[module].contains(never),
            "{module} must not use {never}"
        );
    }
}

#[test]
fn the_dependency_check_sees_a_use_the_table_does_not_allow() {
    let table = dependency_table("//! | `store` | `config` |\n//! | `config` | |\n");
    assert_eq!(table["store"], BTreeSet::from(["config".to_string()]));
    assert!(table["config"].is_empty());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The real store uses `provider`, which this table does not allow.
    assert!(used_modules(root, "store").contains("provider"));
}

/// Issue 29: the written tour stays true. Every `src/**/*.rs` has its room in
/// `docs/architecture.md`'s module table: a row for its own path, or the row of a folder above
/// it that names the rest of its path in backticks (`` `src/worker/` `` ... `` `attempt.rs` ``).
#[test]
fn every_source_file_has_a_room_in_the_architecture_module_table() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let table = doc
        .split("## Modules")
        .nth(1)
        .expect("docs/architecture.md has a Modules section");
    let rows: Vec<(String, String)> = table
        .lines()
        .take_while(|l| l.starts_with('|') || l.trim().is_empty())
        .filter_map(|l| {
            let l = l.strip_prefix("| `")?;
            let (path, rest) = l.split_once('`')?;
            Some((path.to_string(), rest.to_string()))
        })
        .collect();
    assert!(!rows.is_empty(), "no module table rows");
    let mut files = Vec::new();
    files_under(&root.join("src"), &mut files);
    let mut missing = Vec::new();
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs"))
    {
        let path = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let housed = rows.iter().any(|(row, room)| {
            row == &path
                || path
                    .strip_prefix(row.as_str())
                    .is_some_and(|rest| row.ends_with('/') && room.contains(&format!("`{rest}`")))
        });
        if !housed {
            missing.push(path);
        }
    }
    assert!(
        missing.is_empty(),
        "docs/architecture.md's module table does not name: {missing:?}"
    );
    // And every row names something that exists.
    for (row, _) in &rows {
        assert!(
            root.join(row).exists(),
            "the module table names {row}, which does not exist"
        );
    }
    // So does every path the "where to make a change" table sends a reader to.
    let changes = doc
        .split("## Where to make a change")
        .nth(1)
        .and_then(|t| t.split("\n## ").next())
        .expect("docs/architecture.md has a \"Where to make a change\" section");
    let named: Vec<&str> = changes
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|p| p.starts_with("src/") || p.starts_with("tests/") || p.starts_with("docs/"))
        .collect();
    assert!(
        named.len() >= 4,
        "the four changes name their files: {named:?}"
    );
    for path in named {
        assert!(
            root.join(path).exists(),
            "\"where to make a change\" names {path}, which does not exist"
        );
    }
}

/// Issue 29: `docs/decisions.md` numbers its decisions 1, 2, 3, ... with no gap (a withdrawn
/// one keeps its number and says so).
#[test]
fn decisions_are_numbered_without_a_gap() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/decisions.md")).unwrap();
    let numbers: Vec<u32> = doc
        .lines()
        .filter_map(|l| {
            let (n, rest) = l.split_once(". **")?;
            let _ = rest;
            n.parse().ok()
        })
        .collect();
    assert!(!numbers.is_empty());
    let expected: Vec<u32> = (1..=numbers.len() as u32).collect();
    assert_eq!(
        numbers, expected,
        "docs/decisions.md: numbers out of order or with a gap"
    );
}

/// Issue 29: the dependency check sees every path form a module can use another by.
#[test]
fn the_dependency_check_sees_grouped_and_super_paths() {
    let names = |text: &str, depth: usize| -> Vec<String> {
        crate_level_names(text, depth).into_iter().collect()
    };
    assert_eq!(
        names("use crate::{config::Config, store::{self, X}, hub};", 1),
        ["config", "hub", "store"]
    );
    assert_eq!(names("use crate::metrics as m;", 1), ["metrics"]);
    assert_eq!(
        names("let x = super::super::ledger::count();", 2),
        ["ledger"]
    );
    assert_eq!(
        names("use super::super::{store, hub::Hub};", 2),
        ["hub", "store"]
    );
    // One level short of the crate root is a sibling, not a crate module.
    assert!(names("use super::retry;", 2).is_empty());
    assert_eq!(names("use super::retry;", 1), ["retry"]);
    // `my_crate::x` is not `crate::x`.
    assert!(names("use my_crate::config;", 1).is_empty());
    let src = Path::new("/r/src");
    assert_eq!(module_depth(src, Path::new("/r/src/hub.rs")), 1);
    assert_eq!(module_depth(src, Path::new("/r/src/worker/mod.rs")), 1);
    assert_eq!(module_depth(src, Path::new("/r/src/worker/attempt.rs")), 2);
    assert_eq!(
        module_depth(src, Path::new("/r/src/store/sqlite/writer.rs")),
        3
    );
}

/// The dotted keys a configuration written as TOML names (`workers.lease_secs`,
/// `backends.name`: an array of tables contributes the keys of every entry).
fn keys_named_in(value: &serde_json::Value) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let serde_json::Value::Object(top) = value else {
        return keys;
    };
    for (key, value) in top {
        let tables: Vec<&serde_json::Map<String, serde_json::Value>> = match value {
            serde_json::Value::Object(table) => vec![table],
            serde_json::Value::Array(items) => items.iter().filter_map(|v| v.as_object()).collect(),
            _ => Vec::new(),
        };
        for table in tables {
            keys.extend(table.keys().map(|k| format!("{key}.{k}")));
        }
        keys.insert(key.clone());
    }
    keys
}

/// CLI-4: docs/configuration.md's "A complete example" says it holds every key. It loads as a
/// configuration (valid, as `holdfast serve --config` would take it) and names every key the
/// code accepts, so a new key cannot be left out of it.
#[test]
fn docs_configuration_complete_example_loads_and_names_every_key_cli4() {
    use figment::providers::{Format, Toml};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let section = doc
        .split("## A complete example")
        .nth(1)
        .expect("docs/configuration.md has a complete example");
    let example = section
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the complete example is a toml block");
    let named: serde_json::Value = figment::Figment::from(Toml::string(example))
        .extract()
        .expect("the complete example is TOML");
    let missing: Vec<_> = config_keys()
        .difference(&keys_named_in(&named))
        .cloned()
        .collect();
    assert!(
        missing.is_empty(),
        "keys the complete example leaves out: {missing:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("holdfast.toml");
    std::fs::write(&path, example).unwrap();
    holdfast::config::Config::load(Some(&path))
        .expect("the complete example is a valid configuration");
}
