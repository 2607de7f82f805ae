//! `kvgate rooms` and `kvgate abort ROOM`: engine-API calls against a running gateway through
//! kvgate-client. Never changes anything but the one room named.

use crate::cli::Target;
use kvgate_client::{room_key, Client};
use std::path::PathBuf;

fn socket_of(target: &Target) -> Result<PathBuf, i32> {
    if let Some(s) = &target.socket {
        return Ok(s.clone());
    }
    match crate::config::load_config(target.config.as_deref()) {
        Ok(c) => Ok(PathBuf::from(c.engine_api.unix_socket)),
        Err(e) => {
            eprintln!("{e}");
            Err(2)
        }
    }
}

fn with_client<F, Fut>(target: Target, f: F) -> i32
where
    F: FnOnce(Client) -> Fut,
    Fut: std::future::Future<Output = i32>,
{
    let socket = match socket_of(&target) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async move {
        match Client::connect_unix(&socket).await {
            Ok(client) => f(client).await,
            Err(e) => {
                eprintln!("{}: {e}", socket.display());
                1
            }
        }
    })
}

pub fn rooms(target: Target, all: bool) -> i32 {
    with_client(target, |client| async move {
        match client.list_rooms(all).await {
            Ok(rooms) => {
                println!(
                    "{:<14} {:<4} {:<9} {:<16} {:<10} {:<8} {:>9} {:>14} reason",
                    "room", "gen", "role", "state", "peer", "plugin", "age_ms", "bytes"
                );
                for r in &rooms {
                    let key = r.key.unwrap_or_default();
                    println!(
                        "{:<14} {:<4} {:<9} {:<16} {:<10} {:<8} {:>9} {:>14} {}",
                        key.room,
                        key.generation,
                        r.role,
                        r.state,
                        r.peer,
                        r.plugin,
                        r.age_ms,
                        format!("{}/{}", r.bytes_done, r.bytes_total),
                        r.reason
                    );
                }
                println!("{} room(s)", rooms.len());
                0
            }
            Err(status) => {
                eprintln!("rooms: {}", status.message());
                1
            }
        }
    })
}

pub fn abort(target: Target, room: u64, generation: u32) -> i32 {
    with_client(target, |client| async move {
        match client.abort(room_key(room, generation), "kvgate abort (operator)").await {
            Ok(was_live) => {
                println!(
                    "room {room}#{generation} aborted ({})",
                    if was_live { "it was live" } else { "it was not live; a tombstone refuses late counterparts" }
                );
                0
            }
            Err(status) => {
                eprintln!("abort: {}", status.message());
                1
            }
        }
    })
}
