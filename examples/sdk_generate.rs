//! Generates from a deployment of a running brigade cluster with the Rust SDK.
//!
//! ```sh
//! brigade cluster local --workers 3 &        # writes the client config this example reads
//! cargo run -p brigade-sdk --example sdk_generate -- stories "Once upon a time"
//! ```

use brigade_sdk::{Client, ClientConfig, Event, GenerateParams};
use std::io::Write;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args.next().unwrap_or_else(|| "stories".into());
    let prompt = args.next().unwrap_or_else(|| "Once upon a time".into());
    let mut client = Client::connect(ClientConfig::from_env()?).await?;
    let mut events = client.generate(&model, &prompt, GenerateParams::greedy(64)).await?;
    print!("{prompt}");
    while let Some(ev) = events.next().await {
        match ev? {
            Event::Token { text, .. } => {
                print!("{text}");
                std::io::stdout().flush()?;
            }
            Event::Done(d) => {
                println!("{}", d.text_tail);
                if let Some(t) = d.timings {
                    eprintln!("{} tokens, {:.1} tokens/s", t.generated_tokens, t.generate_tokens_per_s);
                }
            }
            Event::Prompt(_) => {}
        }
    }
    Ok(())
}
