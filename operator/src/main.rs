//! `gpuledger-operator`: the operator binary.
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "gpuledger-operator", version, about = "gpuledger operator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print every gpuledger CRD as YAML, or write one file per CRD into --out-dir.
    Crds {
        /// Directory to write `<crd name>.yaml` files into (stdout when absent).
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Crds { out_dir } => print_crds(out_dir),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuledger-operator: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_crds(out_dir: Option<PathBuf>) -> Result<(), Box<dyn std::error::Error>> {
    match out_dir {
        None => {
            let yaml = gpuledger_crds::all_crds_yaml()?;
            std::io::stdout().write_all(yaml.as_bytes())?;
        }
        Some(dir) => {
            std::fs::create_dir_all(&dir)?;
            for crd in gpuledger_crds::crds() {
                let path = dir.join(gpuledger_crds::crd_file_name(&crd));
                std::fs::write(&path, gpuledger_crds::crd_yaml(&crd)?)?;
                eprintln!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}
