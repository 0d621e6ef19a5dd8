# These feed providers/aws.py:
#   AwsCompute(ami_by_region={region: ami_id},
#              security_group_by_region={region: security_group_id},
#              subnet_by_zone=subnet_ids_by_az,
#              instance_profile=instance_profile_name)

output "region" {
  description = "AWS region of this module instance (key of ami_by_region / security_group_by_region)."
  value       = var.region
}

output "subnet_ids_by_az" {
  description = "Private subnet id per availability zone (subnet_by_zone)."
  value       = { for az, s in aws_subnet.private : az => s.id }
}

output "subnet_ids_by_az_id" {
  description = "The same subnets by availability zone ID (use1-az1): price catalogs name zones by ID (subnet_by_zone)."
  value       = { for az, s in aws_subnet.private : s.availability_zone_id => s.id }
}

output "security_group_id" {
  description = "Security group of the job nodes (security_group_by_region[region])."
  value       = aws_security_group.nodes.id
}

output "placement_group_name" {
  description = "Cluster placement group for the nodes of one multi-node gang."
  value       = aws_placement_group.gang.name
}

output "instance_profile_name" {
  description = "IAM instance profile of the job nodes (instance_profile)."
  value       = aws_iam_instance_profile.node.name
}

output "launch_template_id" {
  description = "Launch template (AMI, IMDSv2, encrypted root, instance profile, security group)."
  value       = aws_launch_template.node.id
}

output "ami_id" {
  description = "GPU AMI of the job nodes (ami_by_region[region])."
  value       = local.ami_id
}
