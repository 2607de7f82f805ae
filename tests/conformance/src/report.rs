//! The result of a run: one verdict per clause with its evidence, rendered as a short table for a
//! person, JSON and JUnit XML for machines. Never computes a verdict; it only renders them.

use serde::Serialize;

#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Fail,
    Unsupported,
    /// The check ran and saw no violation, but the situation the clause is about never arose (a
    /// cancel that never reached a live transfer, say): nothing was shown either way. Not a pass: a
    /// run with such a clause certifies nothing.
    NotExercised,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "fail",
            Status::Unsupported => "unsupported",
            Status::NotExercised => "not_exercised",
        }
    }
}

#[derive(Serialize, Clone, Debug)]
pub struct ClauseResult {
    pub id: String,
    pub group: String,
    pub status: Status,
    /// What was done, what was seen, how long it took (or, for unsupported, why).
    pub evidence: String,
    pub elapsed_ms: u64,
}

#[derive(Serialize, Clone, Debug)]
pub struct Report {
    pub plugin: String,
    pub plugin_name: String,
    pub abi_version: u32,
    pub seed: u64,
    pub profile: String,
    pub limits: crate::config::HarnessLimits,
    pub clauses: Vec<ClauseResult>,
    pub elapsed_ms: u64,
}

impl Report {
    pub fn failed(&self) -> Vec<&ClauseResult> {
        self.clauses.iter().filter(|c| c.status == Status::Fail).collect()
    }

    /// Whether the run certifies the plugin: no clause failed, none was left not exercised, and at
    /// least one passed (a plugin unsupported everywhere is not certified, though nothing failed).
    pub fn certified(&self) -> bool {
        let has = |s| self.clauses.iter().any(|c| c.status == s);
        !has(Status::Fail) && !has(Status::NotExercised) && has(Status::Pass)
    }

    /// The report as JSON, with `certified` (see [`Report::certified`]) beside the clauses.
    pub fn to_json(&self) -> String {
        let mut value = serde_json::to_value(self).expect("report serialises");
        value["certified"] = serde_json::Value::Bool(self.certified());
        serde_json::to_string_pretty(&value).expect("report serialises")
    }

    pub fn to_table(&self) -> String {
        let mut out = format!(
            "kvgate conformance: plugin {} ({}), ABI v{}, seed {}, profile {}\n",
            self.plugin, self.plugin_name, self.abi_version, self.seed, self.profile
        );
        out.push_str(&format!("{:<12} {:<13} {:>7}  evidence\n", "clause", "status", "ms"));
        for c in &self.clauses {
            let flat: String = c.evidence.split_whitespace().collect::<Vec<_>>().join(" ");
            let mut evidence: String = flat.chars().take(110).collect();
            if flat.chars().count() > 110 {
                evidence.push('…');
            }
            out.push_str(&format!("{:<12} {:<13} {:>7}  {}\n", c.id, c.status.as_str(), c.elapsed_ms, evidence));
        }
        let count = |s| self.clauses.iter().filter(|c| c.status == s).count();
        out.push_str(&format!(
            "{} pass, {} fail, {} unsupported, {} not exercised in {} ms: {}; replay with --seed {}\n",
            count(Status::Pass),
            count(Status::Fail),
            count(Status::Unsupported),
            count(Status::NotExercised),
            self.elapsed_ms,
            if self.certified() { "certified" } else { "NOT certified" },
            self.seed
        ));
        out
    }

    pub fn to_junit(&self) -> String {
        let count = |s| self.clauses.iter().filter(|c| c.status == s).count();
        let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        out.push_str(&format!(
            "<testsuite name=\"kvgate-conformance.{}\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" time=\"{:.3}\">\n",
            xml(&self.plugin_name),
            self.clauses.len(),
            count(Status::Fail) + count(Status::NotExercised),
            count(Status::Unsupported),
            self.elapsed_ms as f64 / 1000.0
        ));
        out.push_str(&format!(
            "  <properties><property name=\"seed\" value=\"{}\"/><property name=\"plugin\" value=\"{}\"/></properties>\n",
            self.seed,
            xml(&self.plugin)
        ));
        for c in &self.clauses {
            out.push_str(&format!(
                "  <testcase classname=\"conformance.{}\" name=\"{}\" time=\"{:.3}\"",
                xml(&c.group),
                xml(&c.id),
                c.elapsed_ms as f64 / 1000.0
            ));
            match c.status {
                Status::Pass => out.push_str(&format!("><system-out>{}</system-out></testcase>\n", xml(&c.evidence))),
                Status::Fail => out.push_str(&format!(
                    "><failure message=\"{}\">{}</failure></testcase>\n",
                    xml(&c.evidence.chars().take(200).collect::<String>()),
                    xml(&c.evidence)
                )),
                Status::Unsupported => {
                    out.push_str(&format!("><skipped message=\"{}\"/></testcase>\n", xml(&c.evidence)))
                }
                // Not a pass and not a skip: the run certifies nothing while a clause is not exercised.
                Status::NotExercised => out.push_str(&format!(
                    "><failure type=\"not_exercised\" message=\"not exercised: {}\">{}</failure></testcase>\n",
                    xml(&c.evidence.chars().take(200).collect::<String>()),
                    xml(&c.evidence)
                )),
            }
        }
        out.push_str("</testsuite>\n");
        out
    }
}

fn xml(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control() || *c == '\n' || *c == '\t')
        .map(|c| match c {
            '<' => "&lt;".to_string(),
            '>' => "&gt;".to_string(),
            '&' => "&amp;".to_string(),
            '"' => "&quot;".to_string(),
            '\'' => "&apos;".to_string(),
            c => c.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn junit_escapes_and_counts() {
        let r = Report {
            plugin: "x.so".into(),
            plugin_name: "x".into(),
            abi_version: 1,
            seed: 7,
            profile: "quick".into(),
            limits: Default::default(),
            clauses: vec![
                ClauseResult {
                    id: "A-1".into(),
                    group: "A".into(),
                    status: Status::Fail,
                    evidence: "a<b & \"c\"".into(),
                    elapsed_ms: 3,
                },
                ClauseResult {
                    id: "A-2".into(),
                    group: "A".into(),
                    status: Status::Unsupported,
                    evidence: "no gpu".into(),
                    elapsed_ms: 0,
                },
            ],
            elapsed_ms: 5,
        };
        let x = r.to_junit();
        assert!(x.contains("failures=\"1\"") && x.contains("skipped=\"1\""), "{x}");
        assert!(x.contains("a&lt;b &amp; &quot;c&quot;"), "{x}");
        let j: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(j["clauses"][0]["status"], "fail");
        assert_eq!(j["clauses"][1]["status"], "unsupported");
        assert_eq!(j["seed"], 7);
        assert_eq!(j["certified"], false);
    }

    fn report_of(statuses: &[Status]) -> Report {
        let clauses = statuses
            .iter()
            .enumerate()
            .map(|(i, s)| ClauseResult {
                id: format!("A-{i}"),
                group: "A".into(),
                status: *s,
                evidence: format!("evidence {i}"),
                elapsed_ms: 1,
            })
            .collect();
        Report {
            plugin: "x.so".into(),
            plugin_name: "x".into(),
            abi_version: 1,
            seed: 7,
            profile: "quick".into(),
            limits: Default::default(),
            clauses,
            elapsed_ms: 5,
        }
    }

    #[test]
    fn a_clause_not_exercised_is_shown_everywhere_and_certifies_nothing() {
        let r = report_of(&[Status::Pass, Status::NotExercised, Status::Unsupported]);
        assert!(!r.certified());
        let table = r.to_table();
        assert!(
            table.contains("not_exercised") && table.contains("1 not exercised") && table.contains("NOT certified"),
            "{table}"
        );
        let j: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(j["clauses"][1]["status"], "not_exercised");
        assert_eq!(j["certified"], false);
        let x = r.to_junit();
        assert!(x.contains("failures=\"1\"") && x.contains("type=\"not_exercised\""), "{x}");
        assert!(report_of(&[Status::Pass, Status::Unsupported]).certified());
        assert!(report_of(&[Status::Pass, Status::Pass]).to_table().contains(": certified;"));
        assert!(!report_of(&[Status::Unsupported]).certified(), "nothing passed: nothing certified");
        assert!(!report_of(&[Status::Pass, Status::Fail]).certified());
    }
}
