//! The command line of `gpuledger-operator`: its subcommands and their flags. It lives in the
//! library so that the flag tables in `operator/README.md` are checked against it (the tests
//! below); `src/main.rs` parses it and runs the subcommand.

use std::path::PathBuf;

// Plain comments on `Cli` and `Command`: clap would turn doc comments into help text.

// `gpuledger-operator <subcommand>`.
#[derive(clap::Parser)]
#[command(name = "gpuledger-operator", version, about = "gpuledger operator")]
pub struct Cli {
    // The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

// The subcommands; each variant's doc comment is its help.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Run the operator: scheduler extender, reservation ledger and controllers.
    Run(Box<crate::run::config::RunConfig>),
    /// Print every gpuledger CRD as YAML, or write one file per CRD into --out-dir.
    Crds {
        /// Directory to write `<crd name>.yaml` files into (stdout when absent).
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// Check the ledger's invariants on a live cluster: no over-committed GPU, no reservation
    /// without a live pod, no GPU pod without a reservation, no silent misalignment, no refit left
    /// pending past its deadline. Exit 0 when clean, 1 with findings, 2 when the cluster could not
    /// be read.
    Audit {
        /// Kubeconfig file; when absent, $KUBECONFIG (one path or a list) or ~/.kube/config,
        /// else the in-cluster config.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Seconds a RefitRequest may stay pending past its deadline before it is reported.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i64).range(0..))]
        refit_grace_seconds: i64,
        /// When the first look finds anything, look again this much later and report only what
        /// both looks found (a cluster caught mid-step, a pod just finished before its
        /// reservation was released, is not a finding); 0 looks once.
        #[arg(long, default_value = "5s", value_parser = gpuledger_crds::duration::parse_duration)]
        confirm_after: std::time::Duration,
    },
    /// Evaluate a JSON fit scenario (nodes, usage, pod, policy, optional allowed set) and print
    /// where the pod would go and why not elsewhere. Bad input exits with 2.
    Fit {
        /// Scenario file, or `-` for stdin.
        #[arg(long)]
        input: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use gpuledger_crds::flags_doc::disagreements;

    const README: &str = include_str!("../README.md");

    #[test]
    fn audit_refuses_a_negative_grace_naming_the_flag() {
        use clap::Parser;
        let err = Cli::try_parse_from(["op", "audit", "--refit-grace-seconds=-1"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--refit-grace-seconds"), "{err}");
        assert!(Cli::try_parse_from(["op", "audit", "--refit-grace-seconds=0"]).is_ok());
    }

    /// Every flag of every subcommand has its row in operator/README.md, under
    /// "### `<subcommand>`", with the flag's environment variable and default; every row there
    /// names a flag that exists. A new subcommand fails until its section is written.
    #[test]
    fn readme_documents_every_flag_of_every_subcommand() {
        let root = Cli::command();
        // Flags of the top-level command (none but clap's own) go straight under "## Flags".
        let mut problems = disagreements(root.clone(), README, "## Flags");
        for sub in root.get_subcommands() {
            let heading = format!("### `{}`", sub.get_name());
            problems.extend(disagreements(sub.clone(), README, &heading));
        }
        assert!(
            problems.is_empty(),
            "operator/README.md and the flags disagree:\n{}",
            problems.join("\n")
        );
    }
}
