//! The clause/test cross-reference: which clauses CONFORMANCE.md defines (and which it says the
//! harness checks), which ids the code cites (`CONFORMANCE: ID, ID`), and what is missing or unknown.
//! Pure functions over text, so the check itself is tested; never edits a file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[derive(Debug, Default)]
pub struct Contract {
    /// Every clause id, in document order.
    pub clauses: Vec<String>,
    /// Clauses whose "Checked by" names the harness.
    pub harness_checked: BTreeSet<String>,
    /// Deliberate gaps: id → reason.
    pub exceptions: BTreeMap<String, String>,
    /// Clauses whose "Enforced by" names `plugin` (every transport plugin must make them true).
    pub plugin_enforced: BTreeSet<String>,
}

/// Whether an "Enforced by:" line names `plugin` among the enforcers (parenthesised remarks, such as
/// "the core's `plugin_grace` timer", do not count).
fn names_plugin(enforced_by: &str) -> bool {
    let mut plain = String::new();
    let mut depth = 0usize;
    for ch in enforced_by.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => plain.push(ch),
            _ => {}
        }
    }
    let first_sentence = plain.split('.').next().unwrap_or("");
    first_sentence.split(',').any(|who| who.trim() == "plugin")
}

fn clause_id_at_start(line: &str) -> Option<String> {
    let rest = line.strip_prefix("**")?;
    let end = rest.find("**")?;
    let id = &rest[..end];
    is_clause_id(id).then(|| id.to_string())
}

pub fn is_clause_id(s: &str) -> bool {
    let Some((group, num)) = s.split_once('-') else { return false };
    !group.is_empty()
        && group.chars().all(|c| c.is_ascii_uppercase())
        && !num.is_empty()
        && num.chars().all(|c| c.is_ascii_digit())
}

pub fn parse_contract(text: &str) -> Contract {
    let mut c = Contract::default();
    let mut current: Option<String> = None;
    let mut in_exceptions = false;
    let mut in_checked_by = false;
    for line in text.lines() {
        if line.contains("exceptions-begin") {
            in_exceptions = true;
            continue;
        }
        if line.contains("exceptions-end") {
            in_exceptions = false;
            continue;
        }
        if in_exceptions {
            if let Some((id, reason)) = line.trim().strip_prefix("- ").and_then(|l| l.split_once(':')) {
                c.exceptions.insert(id.trim().to_string(), reason.trim().to_string());
            }
            continue;
        }
        if let Some(id) = clause_id_at_start(line) {
            c.clauses.push(id.clone());
            current = Some(id);
        }
        if let (Some(id), Some((_, enforced_by))) = (&current, line.split_once("Enforced by:")) {
            if names_plugin(enforced_by) {
                c.plugin_enforced.insert(id.clone());
            }
        }
        if line.contains("Checked by:") {
            in_checked_by = true;
        } else if line.trim().is_empty() {
            in_checked_by = false;
        }
        if let Some(id) = &current {
            if in_checked_by && line.contains("harness") {
                c.harness_checked.insert(id.clone());
            }
        }
        if line.starts_with("## ") {
            current = None;
        }
    }
    c
}

/// Ids cited on one line after `CONFORMANCE:` (`CONFORMANCE: ABORT-1, TIME-2 (why)`).
pub fn citations_in_line(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("CONFORMANCE:") {
        rest = &rest[at + "CONFORMANCE:".len()..];
        for token in rest.split(|c: char| c == ',' || c.is_whitespace()).filter(|t| !t.is_empty()) {
            let token = token.trim_matches(|c: char| c == ')' || c == '(' || c == '.' || c == ';' || c == '`');
            if is_clause_id(token) {
                out.push(token.to_string());
            } else {
                break;
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
pub struct Citation {
    pub id: String,
    pub file: PathBuf,
    pub line: usize,
    /// Whether the citing file is a test (under a `tests` directory, or has `#[test]`/`#[cfg(test)]`).
    pub in_test: bool,
}

pub fn citations_in_file(path: &Path, text: &str) -> Vec<Citation> {
    let in_test = path.components().any(|c| c.as_os_str() == "tests")
        || text.contains("#[test]")
        || text.contains("#[cfg(test)]");
    text.lines()
        .enumerate()
        .flat_map(|(i, line)| {
            citations_in_line(line).into_iter().map(move |id| Citation {
                id,
                file: path.to_path_buf(),
                line: i + 1,
                in_test,
            })
        })
        .collect()
}

/// Every `*.rs` file under `dirs` (skipping `target` directories).
pub fn rust_files(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name();
            if p.is_dir() {
                if name != "target" && !name.to_string_lossy().starts_with('.') {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Everything wrong with the cross-reference; empty when it holds.
pub fn problems(contract: &Contract, citations: &[Citation], harness_ids: &[&str]) -> Vec<String> {
    let defined: BTreeSet<&str> = contract.clauses.iter().map(String::as_str).collect();
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for id in &contract.clauses {
        if !seen.insert(id) {
            out.push(format!("{id} is defined twice in CONFORMANCE.md"));
        }
    }
    for c in citations {
        if !defined.contains(c.id.as_str()) {
            out.push(format!("{}:{} cites {}, which CONFORMANCE.md does not define", c.file.display(), c.line, c.id));
        }
    }
    for id in contract.exceptions.keys() {
        if !defined.contains(id.as_str()) {
            out.push(format!("exception for {id}, which CONFORMANCE.md does not define"));
        }
    }
    let tested: BTreeSet<&str> = citations.iter().filter(|c| c.in_test).map(|c| c.id.as_str()).collect();
    for id in &contract.clauses {
        if !tested.contains(id.as_str()) && !contract.exceptions.contains_key(id) {
            out.push(format!("{id} has no test citing it (add `// CONFORMANCE: {id}` to the test that checks it, or an exception with a reason)"));
        }
    }
    for id in &contract.harness_checked {
        if !harness_ids.contains(&id.as_str()) && !contract.exceptions.contains_key(id) {
            out.push(format!("{id} says the harness checks it, but the harness registry has no check for it"));
        }
    }
    for id in harness_ids {
        if !defined.contains(id) {
            out.push(format!("the harness registry checks {id}, which CONFORMANCE.md does not define"));
        } else if !contract.harness_checked.contains(*id) {
            out.push(format!("the harness checks {id}, but CONFORMANCE.md does not say so in its `Checked by`"));
        }
    }
    out
}

/// What a plugin crate fails of the rule "a plugin crate cites, in its own sources, every clause
/// enforced by plugins, except those `exempt` lists for it (with a reason)": each such clause it does
/// not cite, and each exemption that is stale (the clause is cited after all, or is not a plugin's).
pub fn plugin_citation_gaps(
    contract: &Contract,
    plugin: &str,
    cited: &BTreeSet<String>,
    exempt: &[&str],
) -> Vec<String> {
    let mut out = Vec::new();
    for id in &contract.plugin_enforced {
        if !cited.contains(id) && !exempt.contains(&id.as_str()) {
            out.push(format!("plugin {plugin} does not cite {id} (add `// CONFORMANCE: {id}` where it implements it, or an exemption with a reason)"));
        }
    }
    for id in exempt {
        if cited.contains(*id) {
            out.push(format!("plugin {plugin} is exempted from {id} but cites it: drop the exemption"));
        } else if !contract.plugin_enforced.contains(*id) {
            out.push(format!(
                "plugin {plugin} is exempted from {id}, which CONFORMANCE.md does not enforce on plugins"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "## A\n\n**A-1**. Must.\nEnforced by: plugin. Checked by: harness (`A-1`).\n\n**A-2**. Must too.\nEnforced by: core. Checked by: core tests.\n\n**A-3**. Gap.\nChecked by: nothing yet.\n\n## Exceptions\n<!-- exceptions-begin -->\n- A-3: no way to provoke it here\n<!-- exceptions-end -->\n";

    fn cite(id: &str, in_test: bool) -> Citation {
        Citation { id: id.into(), file: "x.rs".into(), line: 1, in_test }
    }

    #[test]
    fn parses_clauses_harness_marks_and_exceptions() {
        let c = parse_contract(DOC);
        assert_eq!(c.clauses, vec!["A-1", "A-2", "A-3"]);
        assert_eq!(c.harness_checked.iter().collect::<Vec<_>>(), vec!["A-1"]);
        assert_eq!(c.exceptions["A-3"], "no way to provoke it here");
    }

    #[test]
    fn citations_are_read_after_the_marker_until_a_non_id() {
        assert_eq!(citations_in_line("// CONFORMANCE: ABORT-1, TIME-2 (the pin)"), vec!["ABORT-1", "TIME-2"]);
        assert_eq!(citations_in_line("//! panics (CONFORMANCE: HYGIENE-1), open"), vec!["HYGIENE-1"]);
        assert!(citations_in_line("no marker ABORT-1").is_empty());
    }

    #[test]
    fn a_clean_cross_reference_has_no_problems() {
        let c = parse_contract(DOC);
        assert_eq!(problems(&c, &[cite("A-1", true), cite("A-2", true)], &["A-1"]), Vec::<String>::new());
    }

    #[test]
    fn plugin_enforced_clauses_are_read_and_remarks_do_not_count() {
        let doc = "**A-1**. x\nEnforced by: plugin (the SDK's `spawn_worker`), core. Checked by: y.\n\n**A-2**. x\nEnforced by: core (and the gateway driver, which drains plugin events). Checked by: y.\n\n**A-3**. x\nEnforced by: core, plugin.\n";
        let c = parse_contract(doc);
        assert_eq!(c.plugin_enforced.iter().collect::<Vec<_>>(), vec!["A-1", "A-3"]);
    }

    #[test]
    fn a_plugin_missing_a_citation_or_keeping_a_stale_exemption_is_reported() {
        let doc =
            "**A-1**. x\nEnforced by: plugin.\n\n**A-2**. x\nEnforced by: plugin.\n\n**A-3**. x\nEnforced by: core.\n";
        let c = parse_contract(doc);
        let cited: BTreeSet<String> = ["A-1".to_string()].into();
        assert!(plugin_citation_gaps(&c, "p", &cited, &["A-2"]).is_empty());
        let p = plugin_citation_gaps(&c, "p", &cited, &[]);
        assert!(p.len() == 1 && p[0].contains("does not cite A-2"), "{p:?}");
        let p = plugin_citation_gaps(&c, "p", &cited, &["A-1", "A-2", "A-3"]);
        assert!(p.iter().any(|l| l.contains("exempted from A-1 but cites it")), "{p:?}");
        assert!(p.iter().any(|l| l.contains("exempted from A-3, which")), "{p:?}");
    }

    #[test]
    fn each_kind_of_gap_is_reported() {
        let c = parse_contract(DOC);
        // A-2 cited only by non-test code; an unknown id; no harness check for A-1; a stray harness id.
        let p = problems(&c, &[cite("A-1", true), cite("A-2", false), cite("B-9", true)], &["A-2"]);
        assert!(p.iter().any(|l| l.contains("B-9") && l.contains("does not define")), "{p:?}");
        assert!(p.iter().any(|l| l.starts_with("A-2 has no test")), "{p:?}");
        assert!(p.iter().any(|l| l.starts_with("A-1 says the harness")), "{p:?}");
        assert!(p.iter().any(|l| l.contains("harness checks A-2")), "{p:?}");
        assert!(!p.iter().any(|l| l.starts_with("A-3")), "A-3 is an exception: {p:?}");
    }
}
